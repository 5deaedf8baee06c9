"""What the scheduler and the workers tell each other, inside vLLM's own messages.

``PykvLoadSpec``/``PykvStoreSpec`` travel scheduler -> worker in vLLM's connector
metadata; ``WorkerReport`` travels worker -> scheduler in vLLM's worker metadata.
All three are small and picklable (tuples of bytes and ints, typed failures).
"""

from __future__ import annotations

from typing import Sequence

from pykv.connector.compat import LoadStoreSpec
from pykv.failures import BlockFailure

NO_SLOT = -1


class PykvLoadSpec(LoadStoreSpec):
    """Blocks to load, in the order of the GPU spec's chunks.

    ``dram_slots[i]``: DRAM slot of key i or ``NO_SLOT``; ``resident[i]``: the bytes
    already sit in that slot (a DRAM hit, no disk I/O) - otherwise the block is read
    from disk (into the slot when one is given: a promotion). ``req_id``: the request,
    so the worker can serve blocks it preloaded for it (and drop its interest).
    """

    def __init__(self, keys: Sequence[bytes], dram_slots: Sequence[int] = (), resident: Sequence[bool] = (),
                 req_id: str | None = None):
        self.keys = tuple(bytes(k) for k in keys)
        self.dram_slots = tuple(dram_slots) or (NO_SLOT,) * len(self.keys)
        self.resident = tuple(resident) or (False,) * len(self.keys)
        self.req_id = req_id
        assert len(self.dram_slots) == len(self.keys) == len(self.resident)

    def __repr__(self) -> str:
        return f"PykvLoadSpec({len(self.keys)} keys, dram={self.dram_slots}, resident={self.resident})"


class PykvStoreSpec(LoadStoreSpec):
    """Blocks to store, in the order of the GPU spec's chunks; ``dram_slots[i]`` as above."""

    def __init__(self, keys: Sequence[bytes], dram_slots: Sequence[int] = ()):
        self.keys = tuple(bytes(k) for k in keys)
        self.dram_slots = tuple(dram_slots) or (NO_SLOT,) * len(self.keys)
        assert len(self.dram_slots) == len(self.keys)

    def __repr__(self) -> str:
        return f"PykvStoreSpec({len(self.keys)} keys, dram={self.dram_slots})"


class WorkerReport:
    """What a worker tells the scheduler-side manager, piggybacked on vLLM's worker metadata.

    ``failed_loads``: keys whose load failed (the worker already quarantined bad files).
    ``failed_stores``: (key, dram_ok) for stores that did not reach disk; ``dram_ok`` says
    the DRAM slot nevertheless holds the block. ``store_error``: the failure of a store
    the medium refused (disk full, read-only), which pauses stores for a while.
    ``stores_ended``: (key, rank) of each block stored through a DRAM slot whose write by
    worker ``rank`` has ended (published or failed), sent for every such block, whatever
    became of its store. Workers release such stores to vLLM as soon as the blocks are in
    their slots (early release), so the scheduler frees a slot only once every rank's end
    has arrived (``pykv.residency.DramResidency``). Merged reports keep every rank's entries.
    """

    def __init__(self) -> None:
        self.failed_loads: list[bytes] = []
        self.failed_stores: list[tuple[bytes, bool]] = []
        self.store_error: BlockFailure | None = None
        self.stores_ended: list[tuple[bytes, int]] = []

    def __bool__(self) -> bool:
        return bool(self.failed_loads or self.failed_stores or self.store_error or self.stores_ended)

    def merge(self, other: "WorkerReport | None") -> "WorkerReport":
        merged = WorkerReport()
        for part in (self, other):
            if part is not None:
                merged.failed_loads += part.failed_loads
                merged.failed_stores += part.failed_stores
                merged.store_error = merged.store_error or part.store_error
                merged.stores_ended += part.stores_ended
        return merged
