"""The policy's bookkeeping: transfer kinds and stages, and the index that finds transfers by
stage and category in FIFO order without scanning them all."""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Iterator


class Kind(enum.Enum):
    LOAD = "load"
    PRELOAD = "preload"
    STORE = "store"


class Stage(enum.Enum):
    QUEUED = "queued"
    OPENING = "opening"
    OPENED = "opened"
    READING = "reading"
    READY = "ready"
    JOINED = "joined"
    DELIVERED = "delivered"
    FILLING = "filling"
    FILLED = "filled"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


_FINAL = {Stage.DONE, Stage.FAILED, Stage.CANCELLED}


@dataclass(eq=False)
class Transfer:
    """The policy's view of one storage-block transfer."""

    id: int
    kind: Kind
    stage: Stage = Stage.QUEUED
    slot: int | None = None
    order: int = 0
    owns_slot: bool = False  # True when the transfer holds a ledger reference on its slot
    claimed: bool = False  # preload: a demand load waits on it (demand priority from now on)
    released: bool = False  # preload: nobody wants it any more; it ends once its I/O is done
    source: int | None = None  # joined load: the preload whose read it waits for
    index: "StageIndex | None" = field(default=None, repr=False)  # kept current when stage or claim change

    def __setattr__(self, name: str, value: object) -> None:
        index = self.__dict__.get("index")
        if index is None or name not in _INDEXED:
            object.__setattr__(self, name, value)
            return
        index.remove(self)
        object.__setattr__(self, name, value)
        index.add(self)

    @property
    def category(self) -> str:
        """``load``, ``store``, ``claimed`` (a preload a load waits on) or ``speculative`` (any other preload)."""
        if self.kind is Kind.PRELOAD:
            return "claimed" if self.claimed else "speculative"
        return self.kind.value


_INDEXED = ("stage", "claimed")
#: the index's categories of each kind (a preload is "claimed" once a load waits on it)
CATEGORIES = {Kind.LOAD: ("load",), Kind.STORE: ("store",), Kind.PRELOAD: ("claimed", "speculative")}


class StageIndex:
    """Live transfers by (stage, category), each bucket in FIFO (``order``) order.

    The policy asks "the oldest opened demand loads", "how many are reading" many times per
    reactor step; with thousands of queued blocks (several long requests) a scan of every
    transfer per question made each step O(n) and a whole load O(n^2).
    """

    def __init__(self) -> None:
        self._buckets: dict[tuple[Stage, str], tuple[list[int], dict[int, Transfer]]] = {}

    def add(self, t: Transfer) -> None:
        if t.stage in _FINAL:
            return
        orders, members = self._buckets.setdefault((t.stage, t.category), ([], {}))
        bisect.insort(orders, t.order)
        members[t.order] = t

    def remove(self, t: Transfer) -> None:
        bucket = self._buckets.get((t.stage, t.category))
        if bucket is None or t.order not in bucket[1]:
            return
        orders, members = bucket
        del orders[bisect.bisect_left(orders, t.order)]
        del members[t.order]

    def oldest_first(self, stage: Stage, category: str) -> Iterator[Transfer]:
        """The bucket's transfers, oldest first; callers may move them to other stages meanwhile."""
        bucket = self._buckets.get((stage, category))
        if not bucket:
            return
        orders, members = bucket
        for order in list(orders):
            t = members.get(order)
            if t is not None:
                yield t

    def size(self, stage: Stage, category: str) -> int:
        bucket = self._buckets.get((stage, category))
        return len(bucket[1]) if bucket else 0

    def of_category(self, category: str) -> Iterator[Transfer]:
        for (_, name), (_, members) in list(self._buckets.items()):
            if name == category:
                yield from list(members.values())
