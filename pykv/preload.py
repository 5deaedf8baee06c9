"""``PreloadPlanner``: which stored blocks to read ahead for requests that still wait.

Scheduler side, pure (no I/O, no vLLM): the connector tells it each request that
enters vLLM's waiting queue (with the request's block keys in order), each
request that leaves it (scheduled, finished, aborted), and once per scheduler
step asks for a plan. A plan names, for each newly planned request, the keys
the worker should read ahead, and the requests whose preloads the worker may
drop. Bounds:

- look-ahead: only the first ``look_ahead`` waiting requests (in arrival order)
  are planned; a request is planned once.
- speculative blocks: the distinct keys held by planned requests never exceed
  ``max_blocks``; a request that does not fit waits for room (later ones wait
  behind it, so the queue order is kept).
- what vLLM would load: the keys of the request's leading run of hits (vLLM
  loads a maximal prefix), and of those only the ones served from disk
  (``tier_of`` says ``Tier.DISK``; DRAM-tier hits need no read).

Requests sharing a prefix share keys: a key is planned once and reference
counted, and the worker reads it once.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from pykv.residency import Tier

TierOf = Callable[[bytes], "Tier | None"]


@dataclass(frozen=True)
class PreloadPlan:
    """One step's instructions for the worker."""

    preloads: dict[Hashable, tuple[bytes, ...]] = field(default_factory=dict)
    released: tuple[Hashable, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.preloads or self.released)


class PreloadPlanner:
    """Bounded look-ahead over waiting requests; see the module docstring."""

    def __init__(self, look_ahead: int, max_blocks: int, *, max_waiting: int = 4096) -> None:
        if look_ahead < 1 or max_blocks < 0 or max_waiting < 1:
            raise ValueError("look_ahead and max_waiting must be >= 1, max_blocks >= 0")
        self.look_ahead, self.max_blocks, self.max_waiting = look_ahead, max_blocks, max_waiting
        self._waiting: OrderedDict[Hashable, tuple[bytes, ...]] = OrderedDict()  # not yet planned
        self._planned: OrderedDict[Hashable, tuple[bytes, ...]] = OrderedDict()  # planned keys per request
        self._refs: Counter[bytes] = Counter()  # planned requests per key
        self._released: list[Hashable] = []

    # -- events --------------------------------------------------------------------------------
    def waiting(self, req_id: Hashable, keys: Sequence[bytes]) -> bool:
        """A request entered the waiting queue; False when too many already wait (not tracked)."""
        if req_id in self._waiting or req_id in self._planned:
            return True
        if len(self._waiting) + len(self._planned) >= self.max_waiting:
            return False
        self._waiting[req_id] = tuple(keys)
        return True

    def remove(self, req_id: Hashable) -> None:
        """The request left the waiting queue (scheduled, finished or aborted); its preloads go."""
        self._waiting.pop(req_id, None)
        keys = self._planned.pop(req_id, None)
        if not keys:
            return
        self._released.append(req_id)
        for key in keys:
            self._refs[key] -= 1
            if self._refs[key] <= 0:
                del self._refs[key]

    # -- decisions -----------------------------------------------------------------------------
    def plan(self, tier_of: TierOf) -> PreloadPlan:
        """Plan requests entering the look-ahead window; report those released since last time."""
        preloads: dict[Hashable, tuple[bytes, ...]] = {}
        while self._waiting and len(self._planned) < self.look_ahead:
            req_id, keys = next(iter(self._waiting.items()))
            wanted = self._disk_prefix(keys, tier_of)
            new = [k for k in dict.fromkeys(wanted) if k not in self._refs]
            if new and len(self._refs) + len(new) > self.max_blocks:
                room = self.max_blocks - len(self._refs)
                if room <= 0:
                    break  # wait for room; keep the queue order
                cut = new[room - 1]  # keep the prefix up to the last key that still fits
                wanted = wanted[:wanted.index(cut) + 1]
            del self._waiting[req_id]
            self._planned[req_id] = wanted
            for key in set(wanted):
                self._refs[key] += 1
            if wanted:
                preloads[req_id] = wanted
        released, self._released = tuple(self._released), []
        return PreloadPlan(preloads, released)

    @staticmethod
    def _disk_prefix(keys: Sequence[bytes], tier_of: TierOf) -> tuple[bytes, ...]:
        out = []
        for key in keys:
            tier = tier_of(key)
            if tier is None:
                break
            if tier == Tier.DISK:
                out.append(key)
        return tuple(out)

    # -- queries -------------------------------------------------------------------------------
    def holds(self, key: bytes) -> bool:
        """Some planned request's preload covers ``key`` (the worker may have it staged)."""
        return key in self._refs

    @property
    def planned_blocks(self) -> int:
        return len(self._refs)

    @property
    def planned_requests(self) -> int:
        return len(self._planned)

    def clear(self) -> None:
        """Forget everything (the released requests are still reported once)."""
        for req_id in list(self._planned):
            self.remove(req_id)
        self._waiting.clear()
