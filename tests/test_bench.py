"""``pykv bench`` and ``pykv.bench`` on real files (small sizes: this checks mechanics, not speed)."""

from __future__ import annotations

import json

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
