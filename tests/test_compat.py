"""``pykv/connector/compat.py`` and ``pykv/connector/offload_keys.py``: pykv's vLLM knowledge equals what the
installed vLLM computes.

The offload keys (``chunk_offload_keys``, ``PromptOffloadKeys``) are checked against vLLM's
own code: its request block hasher and its scheduler's ``RequestOffloadState.update_offload_keys``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import RequestOffloadState  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from pykv.connector import compat  # noqa: E402
from pykv.connector.offload_keys import PromptOffloadKeys, chunk_major, chunk_offload_keys  # noqa: E402

HASH_ALGO = "sha256"
TOKENS_PER_HASH = 32


def vllm_request(tokens: list[int], cache_salt: str | None = None) -> Request:
    """A request as vLLM's scheduler sees it, its block hashes computed by vLLM."""
    hash_fn = compat.hash_fn_by_name(HASH_ALGO)
    init_none_hash(hash_fn)
    return Request("r", tokens, SamplingParams(max_tokens=1), None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(TOKENS_PER_HASH, hash_fn))


def vllm_offload_keys(request: Request, groups: list[tuple[int, int]]) -> list[list[bytes]]:
    """Each group's offload keys as vLLM's scheduler builds them (``(group_idx, hashes_per_chunk)``)."""
    configs = tuple(SimpleNamespace(group_idx=g, hashes_per_chunk=h, tokens_per_chunk=h * TOKENS_PER_HASH)
                    for g, h in groups)
    state = RequestOffloadState(SimpleNamespace(kv_group_configs=configs), request,
                                SimpleNamespace(set_offload_key_position=lambda key, tokens: None), None)
    state.update_offload_keys()
    return [list(s.offload_keys) for s in state.group_states]


def prompt(tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(tokens)]


@pytest.mark.parametrize("tokens", [31, 32, 255, 256, 1000])
@pytest.mark.parametrize("groups", [[(0, 8)], [(0, 8), (1, 8)], [(0, 4), (2, 8)]])
def test_chunk_offload_keys_are_the_scheduler_keys(tokens, groups):
    request = vllm_request(prompt(tokens))
    ours = [chunk_offload_keys(request.block_hashes, h, g) for g, h in groups]
    assert ours == vllm_offload_keys(request, groups)
    assert len(ours[0]) == tokens // (groups[0][1] * TOKENS_PER_HASH)


def test_prompt_offload_keys_hash_a_prompt_as_the_scheduler_does():
    tokens = prompt(1000, seed=3)
    request = vllm_request(tokens)
    offloading = SimpleNamespace(cache=SimpleNamespace(tokens_per_hash=TOKENS_PER_HASH, blocks_per_chunk=8),
                                 groups=[SimpleNamespace(tokens_per_block=TOKENS_PER_HASH, group_id=0),
                                         SimpleNamespace(tokens_per_block=TOKENS_PER_HASH, group_id=1)])
    keys = PromptOffloadKeys(offloading, SimpleNamespace(
        cache_config=SimpleNamespace(prefix_caching_hash_algo=HASH_ALGO)))
    assert keys.tokens_per_chunk == 256
    per_group = vllm_offload_keys(request, [(0, 8), (1, 8)])
    assert keys(tokens) == chunk_major(per_group)
    assert keys(tokens) == [per_group[0][0], per_group[1][0], per_group[0][1], per_group[1][1],
                            per_group[0][2], per_group[1][2]]


def test_the_offload_keys_carry_the_cache_salt_in_every_chunk():
    """vLLM mixes ``cache_salt`` into the first block hash and chains the rest from it: no offload key
    of a salted prompt is one of the same prompt's under another salt or none (docs/security.md)."""
    tokens = prompt(1000, seed=5)
    keys = {salt: vllm_offload_keys(vllm_request(tokens, salt), [(0, 8)])[0] for salt in (None, "a", "b")}
    assert all(len(k) == 3 for k in keys.values())
    assert len(set(keys[None]) | set(keys["a"]) | set(keys["b"])) == 9
    assert keys["a"] == vllm_offload_keys(vllm_request(tokens, "a"), [(0, 8)])[0]  # the same salt: the same keys
    salted = vllm_request(tokens, "a")
    assert chunk_offload_keys(salted.block_hashes, 8, 0) == keys["a"]  # what the connector hands the manager


def test_chunk_major_takes_chunk_i_of_every_group_before_chunk_i_plus_one():
    assert chunk_major([[b"a0", b"a1", b"a2"], [b"b0"], []]) == [b"a0", b"b0", b"a1", b"a2"]
    assert chunk_major([]) == []


def test_the_connector_and_the_manager_of_an_engine_are_found_through_compat():
    manager, worker = object(), SimpleNamespace(take_report=lambda: None)
    scheduler_side = SimpleNamespace(connector_scheduler=SimpleNamespace(manager=manager), connector_worker=None)
    worker_side = SimpleNamespace(connector_scheduler=None, connector_worker=SimpleNamespace(worker=worker))
    assert compat.connector_offloading_manager(scheduler_side) is manager
    assert compat.connector_offloading_worker(scheduler_side) is None
    assert compat.connector_offloading_worker(worker_side) is worker
    assert compat.connector_offloading_manager(worker_side) is None
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        scheduler=SimpleNamespace(connector=scheduler_side)))))
    assert compat.scheduler_offloading_manager(llm) is manager
    assert compat.scheduler_offloading_manager(SimpleNamespace()) is None
