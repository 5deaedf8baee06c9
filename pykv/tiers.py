"""The DRAM tier's index: which block keys sit in which DRAM slot, and what to evict.

Pure bookkeeping (no memory, no threads, no vLLM). The scheduler-side manager
owns one ``DramIndex`` and decides every slot assignment itself, so the worker
process, which holds the actual bytes in the reserved part of its staging pool,
only follows the slot ids it is told; nothing is shared between the processes.

An entry is either *pending* (a slot was assigned, the bytes are not there yet:
a store or a promotion is in flight) or *valid* (the bytes in the slot are the
block). Pending entries and entries with pins (a load or store in flight uses
the slot) are never evicted. Replacement among the rest follows an
``EvictionPolicy``, chosen by name from ``EVICTION_POLICIES``:

- ``lru``: least recently used first.
- ``arc``: Adaptive Replacement Cache (Megiddo & Modha): T1 holds keys seen
  once, T2 keys seen again; the ghost lists B1/B2 remember recent evictions and
  steer the target size ``p`` of T1 between recency and frequency.

A new policy is one class implementing ``EvictionPolicy`` plus one line in
``EVICTION_POLICIES`` (the ``dram_policy`` setting accepts every name there).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Protocol, runtime_checkable

Key = Hashable


@dataclass
class DramEntry:
    slot: int
    valid: bool = False
    pins: int = 0


@runtime_checkable
class EvictionPolicy(Protocol):
    """The order in which the DRAM tier gives up its blocks. ``DramIndex`` tells it every
    event; it only keeps its own lists and names a victim when a slot is needed."""

    def miss(self, key: Key) -> None:
        """``key`` is about to be admitted (called before any eviction it causes)."""

    def insert(self, key: Key) -> None:
        """``key`` was admitted."""

    def remove(self, key: Key) -> None:
        """``key`` was dropped (not evicted): forget it, remembering nothing."""

    def hit(self, key: Key) -> None:
        """A valid ``key`` was used."""

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """The key to evict next among those ``evictable`` accepts; None when there is none."""

    def evicted(self, key: Key) -> None:
        """The victim was evicted."""

    def clear(self) -> None:
        """Forget every key (a cache reset)."""


class LruPolicy:
    """Recency order only."""

    def __init__(self, capacity: int) -> None:
        self._order: collections.OrderedDict[Key, None] = collections.OrderedDict()

    def miss(self, key: Key) -> None:
        return

    def insert(self, key: Key) -> None:
        self._order[key] = None

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def hit(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        return next((k for k in self._order if evictable(k)), None)

    def evicted(self, key: Key) -> None:
        self._order.pop(key, None)

    def clear(self) -> None:
        self._order.clear()


class ArcPolicy:
    """ARC lists; ``victim`` picks from T1 or T2 by the adaptive target ``p``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.p = 0.0
        self.t1: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self.t2: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self.b1: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self.b2: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self._ghost_hit: Key | None = None

    def miss(self, key: Key) -> None:
        """A key about to be admitted (before any eviction): a ghost hit adapts ``p``."""
        self._ghost_hit = None
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), float(self.capacity))
            del self.b1[key]
            self._ghost_hit = key
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]
            self._ghost_hit = key

    def insert(self, key: Key) -> None:
        """Admit ``key``: a ghost hit (seen recently) goes to T2, a new key to T1."""
        (self.t2 if key == self._ghost_hit else self.t1)[key] = None
        self._ghost_hit = None

    def remove(self, key: Key) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.pop(key, None)

    def hit(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        first, second = (self.t1, self.t2) if self.t1 and len(self.t1) > self.p else (self.t2, self.t1)
        for lst in (first, second):
            key = next((k for k in lst if evictable(k)), None)
            if key is not None:
                return key
        return None

    def evicted(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        self._trim()

    def _trim(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity:
            self.b2.popitem(last=False)

    def clear(self) -> None:
        for lst in (self.t1, self.t2, self.b1, self.b2):
            lst.clear()
        self.p = 0.0


#: The eviction policies by ``dram_policy`` name: each builds from the tier's capacity.
EVICTION_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LruPolicy,
    "arc": ArcPolicy,
}


class DramIndex:
    """Keys -> DRAM slot ids ``0..capacity-1`` with pending/valid state, pins and eviction.

    Contract: ``allocate`` a slot for a key (pending), then ``commit`` it once the
    bytes are in the slot, or ``drop`` it if they never arrive. ``lookup`` only
    answers for valid entries. ``pin``/``unpin`` bracket every use of a slot by a
    transfer. ``take_evicted`` drains the keys evicted since the last call.
    """

    def __init__(self, capacity: int, policy: str = "lru") -> None:
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(EVICTION_POLICIES)}, got {policy!r}")
        self.capacity = capacity
        self.policy_name = policy
        self._policy: EvictionPolicy = EVICTION_POLICIES[policy](capacity)
        self._entries: dict[Key, DramEntry] = {}
        self._free: collections.deque[int] = collections.deque(range(capacity))
        self._evicted: list[Key] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def lookup(self, key: Key) -> int | None:
        """The slot of a valid entry, else None. Does not change recency."""
        entry = self._entries.get(key)
        return entry.slot if entry is not None and entry.valid else None

    def entry(self, key: Key) -> DramEntry | None:
        return self._entries.get(key)

    def allocate(self, key: Key) -> int | None:
        """Assign a slot to a new pending entry, evicting if needed; None when nothing can be evicted.

        A key that already has an entry keeps it (its slot is returned only if pending
        is acceptable to the caller: check ``entry(key)`` first).
        """
        if key in self._entries:
            raise ValueError(f"key {key!r} already has a DRAM entry")
        self._policy.miss(key)
        if not self._free and not self._evict_one():
            return None
        slot = self._free.popleft()
        self._entries[key] = DramEntry(slot)
        self._policy.insert(key)
        return slot

    def commit(self, key: Key) -> bool:
        """Mark a pending entry valid; False when the key has no entry (it was dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.valid = True
        return True

    def drop(self, key: Key) -> bool:
        """Forget ``key`` and free its slot at once (pins are ignored: the caller knows why)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._policy.remove(key)
        self._free.append(entry.slot)
        return True

    def invalidate(self, key: Key) -> None:
        """Make a valid entry pending again: lookups miss it, eviction skips it, its slot stays
        taken until ``drop`` (for a slot a transfer still reads)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.valid = False

    def pin(self, key: Key) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def touch(self, keys: Iterable[Key]) -> None:
        """Record an access (a hit) to each valid key, oldest first."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.valid:
                self._policy.hit(key)

    def in_use(self) -> list[Key]:
        """Keys whose slot a transfer may still use: pinned or pending entries."""
        return [key for key, entry in self._entries.items() if entry.pins or not entry.valid]

    def take_evicted(self) -> list[Key]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def clear(self, keep: Iterable[Key] = ()) -> None:
        """Forget every entry (pinned or not) and reset the policy; entries in ``keep`` (slots a
        transfer still reads) stay, invalidated, until dropped."""
        kept = {k: self._entries[k] for k in keep if k in self._entries}
        self._entries.clear()
        self._policy.clear()
        taken = {entry.slot for entry in kept.values()}
        self._free = collections.deque(s for s in range(self.capacity) if s not in taken)
        for key, entry in kept.items():
            entry.valid = False
            self._entries[key] = entry
            self._policy.insert(key)

    def _evictable(self, key: Key) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.valid and entry.pins == 0

    def _evict_one(self) -> bool:
        victim = self._policy.victim(self._evictable)
        if victim is None:
            return False
        entry = self._entries.pop(victim)
        self._policy.evicted(victim)
        self._free.append(entry.slot)
        self._evicted.append(victim)
        return True
