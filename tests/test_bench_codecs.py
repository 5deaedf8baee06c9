"""``pykv bench --codec`` (``pykv.bench_codecs``): ratios on KV-like bf16, the load estimate, the
CLI's lines and --json, refusals, and ``pykv bench`` without --codec unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import pykv.bench_codecs as bc
import pykv.commands.bench as bench_cli
from pykv.bench import BenchResult
from pykv.codec import UnknownCodecError
from pykv.commands.app import app
from pykv.config import PykvConfig
from pykv.errors import InputError

MIB = 1 << 20
FAST = ["--no-files", "--size", "8M", "--block-size", "1M", "--depth", "1", "--no-fio"]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_kv_like_is_deterministic_finite_bf16_of_the_asked_length():
    one = bc.kv_like_bf16(MIB)
    assert len(one) == MIB and one == bc.kv_like_bf16(MIB) and one != bc.kv_like_bf16(MIB, seed=1)
    values = torch.frombuffer(bytearray(one), dtype=torch.bfloat16)
    assert torch.isfinite(values).all() and values.float().std() > 0.1
    assert len(bc.kv_like_bf16(4096 + 2)) == 4098  # not a whole page: cut to length


@pytest.fixture(scope="module")
def figures():
    return {(f.codec, f.device): f for f in bc.bench_codecs(["planes-zstd", "fp8", "fp8-zstd", "none"], block_size=MIB,
                                                             threads=2, read_gb_per_s=3.0, min_seconds=0.01)}


def test_ratios_within_known_ranges(figures):
    assert 0.6 <= figures["planes-zstd", "cpu"].ratio <= 0.75
    assert figures["fp8", "cpu"].ratio == 0.5078125  # one e4m3 byte per value + one scale byte per 64
    assert 0.3 <= figures["fp8-zstd", "zstd layer"].ratio < 0.48  # fp8's bytes, zstd-coded
    assert figures["none", "cpu"].ratio == 1.0


def test_every_coded_run_measures_both_ways_and_estimates_the_load(figures):
    for f in figures.values():
        if f.codec == "none":
            assert f.encode_gb_per_s is None and f.decode_gb_per_s is None and f.load_gb_per_s == 3.0
            continue
        assert f.encode_gb_per_s > 0 and f.decode_gb_per_s > 0
        assert f.load_gb_per_s == pytest.approx(min(3.0 / f.ratio, f.decode_gb_per_s))
    assert figures["planes-zstd", "cpu"].threads == 2 and figures["fp8", "cpu"].threads == 2
    assert (("fp8", "cuda") in figures) == torch.cuda.is_available()


def test_load_estimate_is_the_slower_of_reads_and_decoding():
    assert bc.load_estimate(3.0, 0.5, 10.0) == 6.0  # the reads cap it
    assert bc.load_estimate(3.0, 0.68, 2.1) == 2.1  # decoding caps it
    assert bc.load_estimate(3.0, 1.0, None) == 3.0  # nothing to decode
    assert bc.load_estimate(None, 0.5, 10.0) is None


def line(codec="planes-zstd", device="cpu", threads=2, ratio=0.68, encode=0.9, decode=2.1, read=3.0):
    figures = bc.CodecFigures(codec, device, threads, ratio, encode, decode, bc.load_estimate(read, ratio, decode))
    return bc.describe(figures.as_dict(), read)


def test_describe_says_what_caps_the_load_and_whether_raw_is_faster():
    slow = line()
    assert slow.startswith("planes-zstd: 0.68 of the bytes; encode 0.90 GB/s, decode 2.1 GB/s on 2 threads")
    assert "reach 2.1 GB/s of KV here (reads 3.0 GB/s / 0.68 = 4.4, capped by decoding) vs 3.0 raw: raw is faster" \
        in slow
    fast = line(decode=20.0, read=1.0)
    assert "reach 1.5 GB/s" in fast and "capped by the reads" in fast and "1.47x raw, the codec is faster" in fast
    assert line("fp8", "cuda", None, 0.5078125, 90.0, 150.0).startswith("fp8 (cuda): 0.51 of the bytes")
    assert "on the GPU" in line("fp8", "cuda", None, 0.5078125, 90.0, 150.0)
    assert line(read=None).endswith("no raw read pass measured: no load estimate")
    assert line("none", threads=None, ratio=1.0, encode=None, decode=None) == \
        "none: all of the bytes; a load could reach 3.0 GB/s of KV here (the reads)"


def test_the_medium_read_is_the_fastest_raw_read_at_the_deepest_depth():
    results = [{"engine": e, "op": op, "depth": d, "gb_per_s": g, **({"device": dev} if dev else {})}
               for e, op, d, g, dev in [
                   ("pykv io_uring", "read", 4, 9.0, None), ("pykv io_uring", "read", 16, 3.0, None),
                   ("pykv threadpool", "read", 16, 3.5, None), ("pykv io_uring", "write", 16, 7.0, None),
                   ("fio io_uring", "read", 16, 8.0, None), ("pykv reactor files (io_uring)", "read", 16, 8.0, None),
                   ("pykv io_uring", "read", 16, 8.0, "/mnt/a")]]
    assert bc.medium_read(results) == (3.5, "pykv threadpool read, depth 16")
    assert bc.medium_read([r for r in results if r["op"] == "write"]) == (None, None)


def test_codec_names_repeat_or_comma_and_unknown_ones_are_refused_in_one_line():
    assert bc.parse_codecs(["planes-zstd,fp8", " none ", "fp8"]) == ["planes-zstd", "fp8", "none"]
    with pytest.raises(UnknownCodecError) as error:
        bc.parse_codecs(["fp8,zstd"])
    assert isinstance(error.value, InputError)
    assert str(error.value) == "--codec: unknown codec 'zstd' (known: none, planes-zstd, fp8, fp8-zstd)"


def test_cli_prints_a_line_per_codec(tmp_path):
    result = run("bench", "--path", tmp_path, "--codec", "planes-zstd,fp8", *FAST)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(s.startswith("Codecs on one 1.0 MiB block of kv-like bf16, reads: pykv ") for s in lines)
    zstd = [s for s in lines if s.startswith("  planes-zstd: ")]
    fp8 = [s for s in lines if s.startswith("  fp8 (cpu): ")]
    assert len(zstd) == 1 and len(fp8) == 1
    assert "a load could reach" in zstd[0] and " raw: " in zstd[0]
    threads = PykvConfig().codec_worker_threads()
    assert f"on {threads} threads" in zstd[0] and f"on {threads} threads" in fp8[0]
    assert list(tmp_path.iterdir()) == []


def test_cli_json_has_the_codecs(tmp_path):
    result = run("bench", "--path", tmp_path, "--codec", "fp8", "--codec", "planes-zstd", "--codec-threads", "1",
                 *FAST, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    codecs = data["codecs"]
    read = max(r["gb_per_s"] for r in data["results"] if r["op"] == "read")
    assert codecs["threads"] == 1 and codecs["block_size"] == MIB and codecs["read_gb_per_s"] == read
    assert codecs["read_pass"].endswith("read, depth 1")
    runs = {(r["codec"], r["device"]): r for r in codecs["results"]}
    assert list(runs)[:2] == [("fp8", "cpu"), ("planes-zstd", "cpu")]
    assert runs["fp8", "cpu"]["ratio"] == 0.5078 and 0.6 <= runs["planes-zstd", "cpu"]["ratio"] <= 0.75
    for r in runs.values():
        assert r["threads"] == (1 if r["device"] == "cpu" else None)
        assert r["load_gb_per_s"] == pytest.approx(min(read / r["ratio"], r["decode_gb_per_s"]), rel=1e-3)


def test_cli_refuses_an_unknown_codec_in_one_line_before_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_cli, "run_bench", lambda *a, **k: pytest.fail("measured before refusing"))
    result = run("bench", "--path", tmp_path, "--codec", "planes-zstd,lz4", *FAST)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "pykv: error: --codec: unknown codec 'lz4' (known: none, planes-zstd, fp8, fp8-zstd)"]


def fixed_results(directory, **kwargs):
    return [BenchResult("pykv io_uring", "write", 4, MIB, 8 * MIB, 0.004),
            BenchResult("pykv io_uring", "read", 4, MIB, 8 * MIB, 0.002),
            BenchResult("pykv threadpool", "read", 4, MIB, 8 * MIB, 0.003)]


# ``pykv bench`` output for fixed_results as printed before --codec existed (captured from that code)
BEFORE_TABLE = 'O_DIRECT throughput, 1.0 MiB requests, 8.0 MiB  \nper pass, /tmp                                  \nop    ┃ depth ┃ engine          ┃  GB/s ┃ of fio\n━━━━━━╇━━━━━━━╇━━━━━━━━━━━━━━━━━╇━━━━━━━╇━━━━━━━\nread  │     4 │ pykv io_uring   │ 4.194 │      -\nread  │     4 │ pykv threadpool │ 2.796 │      -\nwrite │     4 │ pykv io_uring   │ 2.097 │      -\n'
BEFORE_JSON = '{\n  "path": "/tmp",\n  "block_size": 1048576,\n  "size": 8388608,\n  "repeat": 1,\n  "results": [\n    {\n      "engine": "pykv io_uring",\n      "op": "write",\n      "depth": 4,\n      "block_size": 1048576,\n      "bytes": 8388608,\n      "seconds": 0.004,\n      "gb_per_s": 2.0972\n    },\n    {\n      "engine": "pykv io_uring",\n      "op": "read",\n      "depth": 4,\n      "block_size": 1048576,\n      "bytes": 8388608,\n      "seconds": 0.002,\n      "gb_per_s": 4.1943\n    },\n    {\n      "engine": "pykv threadpool",\n      "op": "read",\n      "depth": 4,\n      "block_size": 1048576,\n      "bytes": 8388608,\n      "seconds": 0.003,\n      "gb_per_s": 2.7962\n    }\n  ]\n}\n'


@pytest.mark.parametrize("extra, before", [([], BEFORE_TABLE), (["--json"], BEFORE_JSON)])
def test_output_without_codec_is_unchanged(monkeypatch, extra, before):
    monkeypatch.setattr(bench_cli, "run_bench", fixed_results)
    monkeypatch.setattr(bench_cli, "bench_codecs", lambda *a, **k: pytest.fail("codecs measured without --codec"))
    result = run("bench", "--size", "8M", "--block-size", "1M", "--depth", "4", "--no-fio", "--path", "/tmp", *extra)
    assert result.exit_code == 0, result.output
    assert result.stdout == before and "codec" not in result.stdout.lower()
