"""``pykv bench`` and ``pykv.bench`` on real files (small sizes: this checks mechanics, not speed)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pykv.bench import bench_files, bench_raw, fio_available
from pykv.commands.app import app

MIB = 1 << 20


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("engine", ["io_uring", "threadpool"])
def test_raw_pass_moves_every_byte_both_ways(tmp_path, engine):
    results = bench_raw(engine, tmp_path / "f", size=8 * MIB, block_size=MIB, depth=4)
    assert [(r.op, r.bytes) for r in results] == [("write", 8 * MIB), ("read", 8 * MIB)]
    assert all(r.engine == f"pykv {engine}" and r.seconds > 0 for r in results)
    assert (tmp_path / "f").stat().st_size == 8 * MIB


def test_files_pass_stores_and_loads_real_blocks(tmp_path):
    results = bench_files("io_uring", tmp_path, size=4 * MIB, block_size=MIB, depth=2)
    assert [(r.op, r.bytes) for r in results] == [("write", 4 * MIB), ("read", 4 * MIB)]
    assert list(tmp_path.iterdir()) == []  # the temp tree is removed


def test_cli_json_lists_every_engine_depth_and_op(tmp_path):
    result = run("bench", "--path", tmp_path, "--size", "4M", "--block-size", "1M", "--depth", "1,4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    seen = {(r["engine"], r["op"], r["depth"]) for r in data["results"]}
    engines = {"pykv io_uring", "pykv threadpool", "pykv reactor files (io_uring)"}
    if fio_available():
        engines.add("fio io_uring")
    assert seen == {(e, op, d) for e in engines for op in ("read", "write") for d in (1, 4)}
    assert all(r["bytes"] == 4 * MIB for r in data["results"])
    assert list(tmp_path.iterdir()) == []


def test_cli_table_shows_ratio_to_fio(tmp_path):
    result = run("bench", "--path", tmp_path, "--size", "2M", "--block-size", "1M", "--depth", "2", "--no-files")
    assert result.exit_code == 0, result.output
    assert "O_DIRECT throughput" in result.stdout and "pykv io_uring" in result.stdout
    if fio_available():
        assert "%" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--block-size", "1000"], "--block-size: 1000 is not a positive multiple of 4096"),
    (["--depth", "1,x"], "--depth"),
    (["--size", "12Q"], "--size: cannot parse size"),
    (["--size", "1M", "--block-size", "2M"], "smaller than --block-size"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    result = run("bench", "--path", tmp_path, *args)
    assert result.exit_code == 2
    assert result.stderr.startswith("pykv: error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1


def test_cli_refuses_a_path_without_o_direct():
    result = run("bench", "--path", "/dev/shm", "--size", "1M", "--block-size", "1M")
    assert result.exit_code == 2 and "does not support O_DIRECT" in result.stderr


def test_files_pass_puts_the_same_number_of_blocks_on_every_device(tmp_path):
    from collections import Counter
    from pykv.bench import block_files
    dirs = [tmp_path / f"d{i}" for i in range(4)]
    for d in dirs:
        d.mkdir()
    with block_files("threadpool", dirs, blocks_per_device=5, block_size=MIB, depth=2) as files:
        lanes = Counter(files.reactor.medium.lane(b.path) for b in files.stores)
        assert lanes == {0: 5, 1: 5, 2: 5, 3: 5}
        assert len({b.key for b in files.stores}) == 20


def test_the_reactor_hashes_on_auto_or_given_verify_threads(tmp_path, monkeypatch):
    import os
    from pykv.bench import block_files
    from pykv.reactor.verify import THREAD_PREFIX
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    dirs = [tmp_path / f"d{i}" for i in range(6)]
    for d in dirs:
        d.mkdir()
    for given, threads in ((None, 6), (5, 5)):
        with block_files("threadpool", dirs, blocks_per_device=2, block_size=MIB, depth=1, verify="full",
                         verify_threads=given) as files:
            assert files.reactor.config.verify_threads == threads
            files.reactor.write("s", files.stores)
            assert not files.reactor.wait_for("s").failed
            files.reactor.read("l", files.loads)
            assert not files.reactor.wait_for("l").failed
            hashing = {t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}
            assert 1 <= len(hashing) <= threads


class SkewedMedium:
    """Two devices; the second gets one key in ``every`` (or none)."""

    lanes = 2

    def __init__(self, every: int | None) -> None:
        self.every = every

    def locate(self, namespace_id: str, key: bytes) -> int:
        return int.from_bytes(key[:8], "big")

    def lane(self, location: int) -> int:
        return 1 if self.every and location % self.every == 0 else 0


def test_even_keys_balance_a_skewed_placement_and_give_up_when_a_device_gets_none():
    from pykv.bench import even_keys
    keys = even_keys(SkewedMedium(7), "ns", 3)
    medium = SkewedMedium(7)
    assert sorted(medium.lane(medium.locate("ns", k)) for k in keys) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(RuntimeError, match="too few"):
        even_keys(SkewedMedium(None), "ns", 3)


def test_bench_depth_reports_when_the_blocks_arrive_at_each_depth(tmp_path):
    import re
    import subprocess
    import sys
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_depth.py"
    result = subprocess.run([sys.executable, str(script), "--dirs", ",".join(map(str, dirs)), "--blocks", "3",
                             "--depths", "2,1", "--repeat", "1", "--block-mib", "1", "--engine", "threadpool"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("depth")]
    assert [int(line.split()[1].rstrip(":")) for line in lines] == [2, 1]
    for line in lines:
        first, quarter, half = (int(x) for x in re.findall(r"(\d+) ms", line)[1:4])
        assert first <= quarter <= half and float(re.search(r"([\d.]+) GB/s", line).group(1)) > 0
