"""A full disk, a read-only tree and a tree deleted while serving: loads go on, stores fail cleanly
(no temp file, no partial block), and stores resume when the tree is usable again.

Through the reactor with both backends on a small tmpfs (needs root to mount), and
through the connector's worker and manager (store pauses, ``store_retry_interval``).
The same with real engines: ``test_reliability_e2e.py`` and ``test_connector_e2e.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pykv.blockfile import check_block
from pykv.format import Geometry
from pykv.tree import KVTree

from reliability.rig import NS, Rig, block_files, key_of, temp_files
from reliability.system import small_tmpfs

GEOMETRY = Geometry(tokens=256, segments=2, segment_bytes=100 * 1024)  # 200 KiB payload, 208 KiB files


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: room for four blocks."""
    with small_tmpfs(tmp_path / "small", "1M") as mount:
        yield mount


def remount(mount: Path, mode: str) -> None:
    """Remount ``ro``/``rw``; retried while a just-finished writer's close is still in flight (EBUSY)."""
    deadline = time.monotonic() + 5
    while subprocess.run(["mount", "-o", f"remount,{mode}", str(mount)], capture_output=True).returncode:
        assert time.monotonic() < deadline, f"cannot remount {mount} {mode}"
        time.sleep(0.05)


def assert_clean(root: Path) -> None:
    """No temp file anywhere; every final-named file a whole, valid block."""
    assert temp_files(root) == []
    for path in block_files(root):
        check_block(Path(path), full=True)


@pytest.mark.parametrize("backend", ["io_uring", "threadpool"])
def test_full_disk_fails_stores_cleanly_and_they_resume_when_space_returns(small_disk, backend):
    keys = [key_of(i) for i in range(8)]
    with Rig(small_disk / "tree", backend=backend, max_payload=GEOMETRY.payload_length) as rig:
        results = [rig.store([k], [GEOMETRY]).result for k in keys]  # one job per block, like an engine
        stored = [k for k, r in zip(keys, results) if r.ok and r.published]
        failed = [k for k, r in zip(keys, results) if not r.ok]
        assert stored and failed, [r.failed for r in results]
        assert all("No space left on device" in str(r) for res in results for r in res.failed.values())
        assert all(r.medium_refuses_stores and r.expected for res in results for r in res.failed.values())
        assert_clean(rig.tree.root)

        loaded = rig.load(stored, [GEOMETRY] * len(stored))  # serving goes on from the full disk
        assert loaded.result.ok and not loaded.mismatched

        for k in stored[:2]:  # space returns (gc)
            os.unlink(rig.path(k))
        resumed = rig.store(failed[:2], [GEOMETRY] * 2).result
        assert resumed.ok and resumed.published == 2
        assert_clean(rig.tree.root)


@pytest.mark.parametrize("backend", ["io_uring", "threadpool"])
def test_read_only_tree_serves_loads_and_refuses_stores_without_leftovers(small_disk, backend):
    keys = [key_of(i) for i in range(3)]
    with Rig(small_disk / "tree", backend=backend, max_payload=GEOMETRY.payload_length) as rig:
        assert rig.store(keys[:2], [GEOMETRY] * 2).result.ok
        remount(small_disk, "ro")
        try:
            refused = rig.store(keys[2:], [GEOMETRY]).result
            assert not refused.ok and "Read-only file system" in str(refused.failed[0])
            assert refused.failed[0].medium_refuses_stores and refused.failed[0].expected
            loaded = rig.load(keys[:2], [GEOMETRY] * 2)
            assert loaded.result.ok and not loaded.mismatched
        finally:
            remount(small_disk, "rw")
        assert rig.store(keys[2:], [GEOMETRY]).result.published == 1
        assert_clean(rig.tree.root)


@pytest.mark.parametrize("backend", ["io_uring", "threadpool"])
def test_tree_deleted_while_serving_is_never_silently_refilled(tmp_path, backend):
    root = tmp_path / "tree"
    keys = [key_of(i) for i in range(4)]
    with Rig(root, backend=backend) as rig:
        geometry = Geometry(256, 2, 3000)
        assert rig.store(keys[:2], [geometry] * 2).result.ok
        shutil.rmtree(root)  # deleted under the running reactor

        gone = rig.load(keys[:2], [geometry] * 2)
        assert set(gone.misses) == {0, 1}  # plain misses: the engine recomputes
        refused = rig.store(keys[2:], [geometry] * 2).result
        assert set(refused.failed) == {0, 1} and not root.exists()

        root.mkdir()  # an empty directory in its place, e.g. the bare mount point of an unmounted disk
        refused = rig.store(keys[2:], [geometry] * 2).result
        assert set(refused.failed) == {0, 1} and list(root.iterdir()) == []  # nothing written there

        KVTree.create(root).ensure_namespace(NS)  # the administrator makes it a tree again
        resumed = rig.store(keys[2:], [geometry] * 2).result
        assert resumed.ok and resumed.published == 2
        again = rig.load(keys[2:], [geometry] * 2)
        assert again.result.ok and not again.mismatched
        assert_clean(root)


def test_the_connector_pauses_stores_and_resumes_after_the_retry_interval(tmp_path):
    """Tree deleted, then a bare directory, then a tree again: loads are misses, stores pause with one
    warning per pause and resume after ``store_retry_interval``; nothing lands in the bare directory."""
    pytest.importorskip("vllm")
    from reliability.connector_rig import chunk_keys, connector

    root = tmp_path / "tree"
    c = connector(str(root), store_retry_interval="0.3s")
    try:
        first, later = chunk_keys(2, salt=1), chunk_keys(6, salt=2)
        c.store(first)
        shutil.rmtree(root)
        failed, report = c.load(first, first_block=20)  # serving: misses, recomputed
        assert failed and report.failed_loads == first and c.worker.counters.get("quarantined", 0) == 0
        c.store(later[:2])
        assert c.worker.counters["store_pauses"] == 1 and c.worker.counters["store_blocks_failed"] == 2
        c.store(later[2:3])  # paused: nothing is even tried
        assert c.manager.counters["pykv:stores_disabled"] == 1
        root.mkdir()
        time.sleep(0.4)
        c.store(later[2:4])
        assert c.worker.counters["store_pauses"] == 2 and list(root.iterdir()) == []
        KVTree.create(root)
        time.sleep(0.4)
        c.store(later[4:6])
        assert c.worker.counters["store_published"] == 2 + 2 and c.worker.counters["store_pauses"] == 2
        assert_clean(root)
        assert sorted(os.path.basename(p)[:-3] for p in block_files(root)) == sorted(k.hex() for k in later[4:6])
    finally:
        c.close()
