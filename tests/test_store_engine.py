"""``io_engine=auto`` settled per medium: io_uring with O_DIRECT, the thread pool on a buffered medium."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from pykv.bench import block_files
from pykv.io.probe import direct_io_supported, uring_available
from pykv.media.build import io_engine_for


class FakeMedium:
    def __init__(self, direct: bool) -> None:
        self.opens_direct = direct


@pytest.mark.parametrize("engine, direct, settled", [
    ("auto", False, "threadpool"), ("auto", True, "auto"),
    ("io_uring", False, "io_uring"), ("io_uring", True, "io_uring"),
    ("threadpool", False, "threadpool"), ("threadpool", True, "threadpool"),
])
def test_auto_is_the_thread_pool_only_on_a_buffered_medium_and_a_given_engine_is_kept(engine, direct, settled):
    assert io_engine_for(engine, FakeMedium(direct)) == settled


def test_a_reactor_over_a_memory_backed_tree_reads_with_the_thread_pool_under_auto():
    if not os.path.isdir("/dev/shm") or direct_io_supported("/dev/shm")[0]:
        pytest.skip("no memory-backed /dev/shm here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        with block_files("auto", [Path(d)], blocks_per_device=1, block_size=1 << 20, depth=1) as files:
            assert not files.reactor.medium.opens_direct and files.reactor.backend.name == "threadpool"
            files.reactor.write("s", files.stores)
            assert not files.reactor.wait_for("s").failed
            files.reactor.read("l", files.loads)
            assert not files.reactor.wait_for("l").failed


@pytest.mark.skipif(not uring_available()[0], reason="io_uring unavailable here")
def test_a_reactor_over_an_o_direct_tree_keeps_io_uring_under_auto(tmp_path):
    if not direct_io_supported(tmp_path)[0]:
        pytest.skip("tmp does not take O_DIRECT")
    with block_files("auto", [tmp_path], blocks_per_device=1, block_size=1 << 20, depth=1) as files:
        assert files.reactor.medium.opens_direct and files.reactor.backend.name == "io_uring"
