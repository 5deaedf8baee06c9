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
- **Early release** (one worker): a store whose blocks all have DRAM slots ends for
  the engine as soon as the blocks are in them; ``store_completed`` then makes them
  hits at once, and keeps each slot pinned while the worker still writes the file
  from it, until ``write_ended`` (either message may come first).
- **Forgetting a key still written** (a failed load): it misses from then on and
  keeps its slot until the write ends.
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
    """The DRAM tier's slots over the life of the transfers that use them; see the module docstring."""

    def __init__(self, capacity: int, policy: str = "lru", *, early_release: bool = False) -> None:
        self.index = DramIndex(capacity, policy)
        self.early_release = early_release
        self._pending_stores: set[Key] = set()
        self._writing: set[Key] = set()  # committed entries whose file a worker still writes from the slot
        self._ended: set[Key] = set()  # writes reported ended before the store was completed
        self._drop_when_written: set[Key] = set()  # forgotten while written: dropped when the write ends
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

    def writes(self) -> tuple[frozenset, frozenset]:
        """Early-released writes: (keys whose slot a worker still writes a file from after the
        engine has the store, keys whose write ended before the engine completed their store)."""
        return frozenset(self._writing), frozenset(self._ended)

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
        """Unpin; promotions become valid (a failed one was dropped by ``load_failed``)."""
        for key in keys:
            if self.index.entry(key) is not None and key not in self._reset_fenced:  # fenced: a pre-reset transfer's
                self.index.unpin(key)
                if key not in self._drop_when_written:  # forgotten while still written: stays a miss
                    self.index.commit(key)

    def load_failed(self, key: Key) -> None:
        """A worker could not load ``key``: forget its entry (a slot still written from stays taken)."""
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
        return slot

    def store_completed(self, keys: Collection[Key], success: bool = True) -> None:
        """The engine completed these stores: DRAM entries become hits; with early release a
        slot stays pinned until its write ends."""
        for key in keys:
            self._pending_stores.discard(key)
            if self.index.entry(key) is None:
                self._ended.discard(key)
                continue
            if not success:
                self.write_ended(key)
                self.index.drop(key)
                continue
            self.index.commit(key)
            if not self.early_release or key in self._ended:
                self._ended.discard(key)
                self.index.unpin(key)
            else:
                self._writing.add(key)

    def write_ended(self, key: Key) -> None:
        """The write from ``key``'s DRAM slot is over: unpin it (or drop it, if forgotten meanwhile)."""
        if key in self._writing:
            self._writing.discard(key)
            self.index.unpin(key)
            if key in self._drop_when_written:
                self._drop_when_written.discard(key)
                if key not in self._reset_fenced:
                    self.index.drop(key)
        elif key in self._pending_stores:  # the engine has not completed the store yet
            self._ended.add(key)

    def store_failed(self, key: Key, dram_ok: bool) -> None:
        """A store did not reach the medium; ``dram_ok``: its DRAM slot holds the block anyway."""
        if dram_ok:
            return
        if key in self._reset_fenced:
            self._writing.discard(key)  # that store is over: its slot waits for the flush only
        else:
            self._forget(key)

    def _forget(self, key: Key) -> None:
        """Drop ``key``'s entry; one a worker still writes from misses from now on and keeps
        its slot until that write ends (one fenced by a reset is already a miss)."""
        if key in self._reset_fenced:
            return
        if key in self._writing:
            self.index.invalidate(key)
            self._drop_when_written.add(key)
        else:
            self.index.drop(key)

    # -- cache reset ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the tier. Slots a transfer in flight still uses stay taken (misses) until
        ``reset_flushed``; slots a file is still written from, also until that write ends."""
        in_flight = set(self.index.in_use())
        if self.early_release:  # a pending store's write may go on after the engine's job ends
            self._writing |= {k for k in self._pending_stores if k in in_flight and k not in self._ended}
        self._reset_fenced |= in_flight
        self.index.clear(keep=in_flight | self._writing)
        self._drop_when_written = set(self._writing)
        self._pending_stores.clear()
        self._ended.clear()

    def reset_flushed(self) -> None:
        """Every job in flight at the last reset ended: free the slots those jobs used, except
        slots a file is still written from."""
        fenced, self._reset_fenced = self._reset_fenced, set()
        for key in fenced:
            if key not in self._writing:
                self.index.drop(key)
