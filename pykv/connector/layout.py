"""What a storage block holds and where it lives, derived from vLLM's ``OffloadingConfig``.

Both processes (scheduler and each worker) compute the namespace and the slot
size from the same ``OffloadingConfig`` fields, so they agree without talking.
The worker adds what only it knows (the canonical KV tensors) in ``BlockLayout``.

Payload of one storage block of KV group ``g`` (one chunk = ``blocks_per_chunk``
consecutive GPU blocks): for each canonical ref of the group, in order, for each
sub-block ``j`` of the chunk, that GPU block's (un-padded) page bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pykv.errors import InputError
from pykv.format import Geometry
from pykv.namespace import Namespace
from pykv.staging import slot_bytes_for

from pykv.connector import compat
from pykv.connector.compat import CanonicalKVCaches, OffloadingConfig
from pykv.config import PykvConfig
from pykv.connector.identity import current_engine_settings, hash_seed_fingerprint, model_identity, warn_about_seed


def tokens_per_chunk(config: OffloadingConfig) -> int:
    return config.groups[0].tokens_per_block * config.cache.blocks_per_chunk


def namespace_for(config: OffloadingConfig, rank: int, *, codec: str = "none") -> Namespace:
    """The namespace of ``rank``'s KV bytes (the scheduler looks up rank 0's).

    Keyed on what the model is and on vLLM's block-hash seed (``pykv.connector.identity``),
    not on the path the model was given by; that path is the namespace's label. ``codec``: the
    ``params`` of the engine's codec (``Codec.params``); ``none`` keeps the namespace of pykv
    before codecs, any other is a fact of the namespace.
    """
    parallel = config.parallel
    tp_size = max(parallel.tp_size, 1)
    algo, revision = current_engine_settings()
    seed = hash_seed_fingerprint(algo, config.engine_id)
    warn_about_seed(seed)
    extra = {
        "block_hash_seed": seed,
        "platform": compat.platform_name(),
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "group_tokens_per_block": ",".join(str(g.tokens_per_block) for g in config.groups),
        "group_layers": ",".join(str(len(g.layer_names)) for g in config.groups),
        "pp_size": parallel.pp_size,
        "pcp_size": getattr(parallel, "pcp_size", 1),
        "dcp_size": getattr(parallel, "dcp_size", 1),
        "world_size": parallel.world_size,
        "rank": rank,
        **Namespace.codec_facts(codec),
    }
    return Namespace(model=model_identity(config.model.name, revision), label=config.model.name,
                     dtype=compat.kv_cache_dtype(config), kv_layout=compat.kv_layout(config),
                     tokens_per_block=tokens_per_chunk(config), tp_size=tp_size, tp_rank=rank % tp_size,
                     pp_rank=(rank // tp_size) % max(parallel.pp_size, 1), extra=tuple(extra.items()))


def slot_bytes(config: OffloadingConfig) -> int:
    """Slot size for any storage block of this engine: an upper bound both sides compute alike."""
    return slot_bytes_for(config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk)


def slot_counts(pykv: PykvConfig, config: OffloadingConfig) -> tuple[int, int]:
    """(transient slots, DRAM slots) of each worker's staging pool; raise if staging is too small."""
    size = slot_bytes(config)
    transient = pykv.transient_slots(size)
    if transient < 2:
        raise InputError(f"kv_connector_extra_config.staging_bytes: {pykv.staging_bytes} bytes hold {transient} "
                         f"storage blocks of {size} bytes; give at least {2 * size} (ideally io_depth + 1 blocks)")
    return transient, pykv.dram_bytes // size


@dataclass(frozen=True)
class RefPage:
    """One canonical ref of a group: which tensor, how many bytes of each block page."""

    tensor: int
    page_bytes: int


@dataclass(frozen=True)
class BlockLayout:
    """Worker-side shape of the storage blocks of each KV group."""

    blocks_per_chunk: int
    tokens: int
    groups: tuple[tuple[RefPage, ...], ...]

    @classmethod
    def from_kv_caches(cls, kv_caches: CanonicalKVCaches, config: OffloadingConfig) -> "BlockLayout":
        groups = tuple(tuple(RefPage(r.tensor_idx, r.page_size_bytes) for r in refs)
                       for refs in kv_caches.group_data_refs)
        layout = cls(config.cache.blocks_per_chunk, tokens_per_chunk(config), groups)
        limit = slot_bytes(config)
        for g in range(len(groups)):
            if slot_bytes_for(layout.geometry(g).payload_length) > limit:
                raise InputError(f"KV group {g}: a storage block of {layout.geometry(g).payload_length} bytes "
                                 f"exceeds worker_kv_bytes_per_block x blocks_per_chunk; unsupported layout")
        return layout

    def geometry(self, group: int) -> Geometry:
        refs = self.groups[group]
        pages = {r.page_bytes for r in refs}
        if len(pages) == 1:
            return Geometry(self.tokens, len(refs) * self.blocks_per_chunk, pages.pop())
        return Geometry(self.tokens, 1, sum(r.page_bytes for r in refs) * self.blocks_per_chunk)

    def offsets(self, group: int) -> list[int]:
        """Byte offset in the payload where each ref's run of sub-block pages starts."""
        out, position = [], 0
        for ref in self.groups[group]:
            out.append(position)
            position += ref.page_bytes * self.blocks_per_chunk
        return out
