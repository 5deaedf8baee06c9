"""Where a block lives and who may still use its DRAM slot: the scheduler's pure ledger.

``DramResidency`` is the scheduler-side half of the store's ledger (the worker-side
half is ``pykv.jobledger.JobLedger``): it decides every DRAM-tier slot assignment
(deterministically, so the worker processes only follow slot ids) and tracks each
slot's life across the transfers that use it. Pure bookkeeping: no I/O, no threads,
no vLLM; the disk is asked by the caller.

A key's DRAM entry (``pykv.tiers.DramIndex``) is *pending* while its bytes are on
their way (a store or a promotion in flight) and *valid* once they are there; a pin
marks every transfer still using the slot. On top of that:

- **Pending stores.** A key being stored is neither stored again nor promoted.
- **Early release** (any number of workers): a store whose blocks all have DRAM slots
  ends for the engine once every worker has the blocks in its slots; ``store_completed``
  then makes them hits at once. Each worker then writes its own file (its rank's
  shard) from its copy of the slot and reports the end (``write_ended``, with its
  rank). The slot stays pinned until the engine completed the store *and* every
  rank reported its end, in any order; a rank that reports twice counts once.
- **A failed store**: when any worker's slot does not hold the block (``dram_ok``
  false), the key never becomes a hit; its slot stays taken until it is free as above.
- **Forgetting a key still used by a store** (a failed load, a failed store): it
  misses from then on and keeps its slot until the store is over on every worker.
- **Cache reset**: the tier is forgotten at once, but a slot that a transfer in
  flight still uses stays taken, as a miss, until ``reset_flushed`` (every job in
  flight at the reset ended) and, for a slot a file is still written from, until
  that write ends. A fenced key is neither stored nor promoted again meanwhile, so
  each end report names one transfer.

``StorePause`` is the pause both processes keep after the medium refused a store.
"""

from __future__ import annotations

import enum
from typing import Collection, Hashable, Iterable

from pykv.tiers import DramIndex

Key = Hashable


class Tier(enum.StrEnum):
    """Where a hit is served from."""

    DRAM = "dram"
    DISK = "disk"


class StorePause:
    """Stores refused for ``interval`` seconds after the medium refused one (disk full,
    read-only); serving goes on. Times come from the caller's clock."""

    def __init__(self, interval: float, *, extend: bool = False) -> None:
        self.interval = interval
        self.extend = extend  # a failure during a pause restarts it (the worker's rule)
        self._until = float("-inf")

    def active(self, now: float) -> bool:
        return now < self._until

    def begin(self, now: float) -> bool:
        """The medium refused a store at ``now``; True when this starts a pause (log it once)."""
        starts = not self.active(now)
        if starts or self.extend:
            self._until = now + self.interval
        return starts


class DramResidency:
    """The DRAM tier's slots over the life of the transfers that use them; see the module docstring.

    ``workers``: how many workers take part in each store (vLLM's world size); with early
    release a store's slot is freed only once every one of them reported its write ended.
    """

    def __init__(self, capacity: int, policy: str = "lru", *, early_release: bool = False,
                 workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.index = DramIndex(capacity, policy)
        self.early_release = early_release
        self.workers = workers
        self._pending_stores: set[Key] = set()
        self._writes: dict[Key, set[int]] = {}  # early release: slots written from -> ranks whose write ended
        self._forgotten: set[Key] = set()  # misses whose slot a store still uses: dropped once it is free
        self._reset_fenced: set[Key] = set()  # in flight at a cache reset: dropped at reset_flushed

    # -- queries -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.index.capacity

    def __len__(self) -> int:
        return len(self.index)

    @property
    def pending_stores(self) -> int:
        return len(self._pending_stores)

    def slot_of(self, key: Key) -> int | None:
        """The slot of a DRAM hit (a valid entry), else None."""
        return self.index.lookup(key)

    def holds(self, key: Key) -> bool:
        """Whether ``key`` is in the tier (any state) or being stored: a store of it is skipped."""
        return key in self._pending_stores or key in self.index

    def writes(self) -> dict[Key, frozenset[int]]:
        """Early-released stores whose slot some worker may still write a file from: key -> the
        ranks that already reported the end of their write."""
        return {key: frozenset(ranks) for key, ranks in self._writes.items()}

    # -- loads ---------------------------------------------------------------------------------
    def pin_hit(self, key: Key) -> int | None:
        """A load served from the tier: pin the valid entry (until ``loads_ended``) and return its slot."""
        slot = self.index.lookup(key)
        if slot is not None:
            self.index.pin(key)
            self.index.touch([key])
        return slot

    def promotion_slot(self, key: Key) -> int | None:
        """A slot (pinned, pending) that a load from disk of ``key`` also fills; None without one.

        A block being preloaded is promoted too: the reactor copies it from the preload's staging
        slot into this one, so it is read once and later hits are DRAM hits."""
        if self.index.capacity == 0 or key in self.index:
            return None
        slot = self.index.allocate(key)
        if slot is not None:
            self.index.pin(key)
        return slot

    def touch(self, keys: Iterable[Key]) -> None:
        self.index.touch(keys)

    def loads_ended(self, keys: Collection[Key]) -> None:
        """Unpin; promotions become valid (a failed one was forgotten by ``load_failed``)."""
        for key in keys:
            if self.index.entry(key) is not None and key not in self._reset_fenced:  # fenced: a pre-reset transfer's
                self.index.unpin(key)
                if key in self._forgotten:  # stays a miss; its slot is freed once nothing uses it
                    self._drop_if_unused(key)
                else:
                    self.index.commit(key)

    def load_failed(self, key: Key) -> None:
        """A worker could not load ``key``: forget its entry (its slot stays taken while in use)."""
        self._forget(key)

    # -- stores --------------------------------------------------------------------------------
    def begin_store(self, key: Key) -> int | None:
        """``key`` will be stored (the caller checked ``holds`` and the disk): its DRAM slot
        (pinned, pending), or None when the tier is off or full of pinned entries."""
        self._pending_stores.add(key)
        if not self.index.capacity:
            return None
        slot = self.index.allocate(key)
        if slot is not None:
            self.index.pin(key)
            if self.early_release:
                self._writes[key] = set()
        return slot

    def store_completed(self, keys: Collection[Key], success: bool = True) -> None:
        """The engine completed these stores (every worker has the blocks in its slots): DRAM
        entries become hits; with early release a slot stays pinned until every write ended."""
        for key in keys:
            self._pending_stores.discard(key)
            if self.index.entry(key) is None or key in self._reset_fenced:  # fenced: reset_flushed frees it
                continue
            if success and key not in self._forgotten:
                self.index.commit(key)
            else:
                self._forget(key)
            if key not in self._writes:
                self._release(key)

    def write_ended(self, key: Key, rank: int = 0) -> None:
        """Worker ``rank``'s write from ``key``'s DRAM slot is over (published or failed); the
        slot is released once every worker's has and the engine completed the store."""
        ranks = self._writes.get(key)
        if ranks is None or not 0 <= rank < self.workers:  # a stale report, or no worker of this engine
            return
        ranks.add(rank)
        if len(ranks) < self.workers:
            return
        del self._writes[key]
        if key not in self._pending_stores and key not in self._reset_fenced:
            self._release(key)

    def store_failed(self, key: Key, dram_ok: bool) -> None:
        """A store did not reach the medium; ``dram_ok``: its DRAM slot holds the block anyway."""
        if not dram_ok:
            self._forget(key)

    def _release(self, key: Key) -> None:
        """The store's use of the slot is over on every worker: unpin (free a forgotten entry)."""
        self.index.unpin(key)
        self._drop_if_unused(key)

    def _forget(self, key: Key) -> None:
        """``key`` misses from now on; its slot is freed once no transfer uses it on any worker
        (a load or a store in flight, a write) - at once when none does. A key fenced by a reset
        is already a miss."""
        if key in self._reset_fenced or self.index.entry(key) is None:
            return
        self.index.invalidate(key)
        self._forgotten.add(key)
        self._drop_if_unused(key)

    def _drop_if_unused(self, key: Key) -> None:
        """Free a forgotten entry's slot once no transfer or write uses it."""
        if key not in self._forgotten:
            return
        entry = self.index.entry(key)
        if entry is None or (entry.pins == 0 and key not in self._pending_stores and key not in self._writes):
            self._forgotten.discard(key)
            self.index.drop(key)

    # -- cache reset ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the tier. Slots a transfer in flight still uses stay taken (misses) until
        ``reset_flushed``; slots a file is still written from, also until every write ends."""
        in_flight = set(self.index.in_use())
        self._reset_fenced |= in_flight
        self.index.clear(keep=in_flight | set(self._writes))
        self._forgotten = set(self._writes)
        self._pending_stores.clear()

    def reset_flushed(self) -> None:
        """Every job in flight at the last reset ended: free the slots those jobs used, except
        slots a file is still written from."""
        fenced, self._reset_fenced = self._reset_fenced, set()
        for key in fenced:
            if key in self._writes:  # the transfers of the reset are over: only the writes' pin is left
                self.index.entry(key).pins = 1
            else:
                self._forgotten.discard(key)
                self.index.drop(key)
