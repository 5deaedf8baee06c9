"""vLLM's offload keys, derived once: for a scheduled request (the connector) and for a plain prompt (warm).

vLLM names a stored chunk by the block hash of its last engine block and the KV cache
group (``make_offload_key``); its scheduler builds them in
``RequestOffloadState.update_offload_keys``. ``tests/test_compat.py`` checks these
functions against that code. vLLM's names come from ``pykv.connector.compat``.
"""

from __future__ import annotations

from typing import Any, Sequence

from pykv.connector import compat


def chunk_offload_keys(block_hashes: Sequence[bytes], hashes_per_chunk: int, group_idx: int) -> list[bytes]:
    """vLLM's offload keys of one KV cache group for a request's block hashes, as its scheduler
    builds them (``RequestOffloadState.update_offload_keys``): one per full chunk, the key of the
    chunk's last block hash."""
    return [compat.make_offload_key(h, group_idx) for h in block_hashes[hashes_per_chunk - 1::hashes_per_chunk]]


def chunk_major(per_group: Sequence[Sequence[bytes]]) -> list[bytes]:
    """Keys of several groups chunk by chunk: chunk i of every group before chunk i + 1."""
    return [keys[i] for i in range(max(map(len, per_group), default=0)) for keys in per_group if i < len(keys)]


class PromptOffloadKeys:
    """``keys(token_ids)``: the offload keys vLLM gives a plain prompt's full chunks (every
    offloaded group, chunk by chunk), from the engine's ``OffloadingConfig`` and ``VllmConfig``.
    Call it only in the engine's process (``compat.prompt_block_hasher``)."""

    def __init__(self, offloading_config: Any, vllm_config: Any) -> None:
        cache = offloading_config.cache
        self.tokens_per_hash = cache.tokens_per_hash
        self.tokens_per_chunk = offloading_config.groups[0].tokens_per_block * cache.blocks_per_chunk
        self.hashes_per_chunk = self.tokens_per_chunk // self.tokens_per_hash
        self.group_ids = compat.group_ids(offloading_config)
        self._hash_chain = compat.prompt_block_hasher(vllm_config)

    def __call__(self, token_ids: Sequence[int]) -> list[bytes]:
        hashes = self._hash_chain(token_ids, self.tokens_per_hash)
        return chunk_major([chunk_offload_keys(hashes, self.hashes_per_chunk, g) for g in self.group_ids])
