"""The policy's bookkeeping: transfer kinds and stages, the index that finds transfers by
stage, category and lane in FIFO order without scanning them all, and the merge of its
buckets into one FIFO stream."""

from __future__ import annotations

import bisect
import enum
import heapq
from dataclasses import dataclass, field
from typing import Iterable, Iterator


class Kind(enum.Enum):
    LOAD = "load"
    PRELOAD = "preload"
    STORE = "store"

    __hash__ = object.__hash__  # members are singletons: C-level identity hash (Enum's is Python-level)


class Stage(enum.Enum):
    QUEUED = "queued"
    OPENING = "opening"
    OPENED = "opened"
    READING = "reading"
    VERIFYING = "verifying"
    READY = "ready"
    JOINED = "joined"
    DELIVERED = "delivered"
    FILLING = "filling"
    FILLED = "filled"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    __hash__ = object.__hash__  # the index hashes stages on every lookup: C-level identity hash


_FINAL = {Stage.DONE, Stage.FAILED, Stage.CANCELLED}


@dataclass(eq=False)
class Transfer:
    """The policy's view of one storage-block transfer."""

    id: int
    kind: Kind
    stage: Stage = Stage.QUEUED
    slot: int | None = None
    order: int = 0
    lane: int = 0  # the device that holds the block (its own in-flight depth); fixed at add
    owns_slot: bool = False  # True when the transfer holds a ledger reference on its slot
    claimed: bool = False  # preload: a demand load waits on it (demand priority from now on)
    released: bool = False  # preload: nobody wants it any more; it ends once its I/O is done
    source: int | None = None  # joined load: the preload whose read it waits for
    brings_slot: bool = False  # came with its caller's slot (a DRAM-tier slot): never waits for one
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
        """``load``, ``store``, ``store_slotted`` (a store that brought its slot), ``claimed`` (a preload
        a load waits on) or ``speculative`` (any other preload)."""
        if self.kind is Kind.PRELOAD:
            return "claimed" if self.claimed else "speculative"
        if self.kind is Kind.STORE and self.brings_slot:
            return "store_slotted"
        return self.kind.value


_INDEXED = ("stage", "claimed")
#: the index's categories of each kind (a preload is "claimed" once a load waits on it)
CATEGORIES = {Kind.LOAD: ("load",), Kind.STORE: ("store", "store_slotted"), Kind.PRELOAD: ("claimed", "speculative")}


class StageIndex:
    """Live transfers by (stage, category, lane), each bucket in FIFO (``order``) order.

    The policy asks "the oldest opened demand loads of lane 2", "how many are reading on lane 0"
    many times per reactor step; with thousands of queued blocks (several long requests) a scan
    of every transfer per question made each step O(n) and a whole load O(n^2).
    """

    def __init__(self) -> None:
        # (stage, category) -> lane -> (orders ascending, order -> transfer)
        self._buckets: dict[tuple[Stage, str], dict[int, tuple[list[int], dict[int, Transfer]]]] = {}

    def add(self, t: Transfer) -> None:
        if t.stage in _FINAL:
            return
        lanes = self._buckets.setdefault((t.stage, t.category), {})
        orders, members = lanes.get(t.lane) or lanes.setdefault(t.lane, ([], {}))
        bisect.insort(orders, t.order)
        members[t.order] = t

    def remove(self, t: Transfer) -> None:
        bucket = self._buckets.get((t.stage, t.category), _NO_LANES).get(t.lane)
        if bucket is None or t.order not in bucket[1]:
            return
        orders, members = bucket
        del orders[bisect.bisect_left(orders, t.order)]
        del members[t.order]

    def oldest_first(self, stage: Stage, category: str, lane: int) -> Iterator[Transfer]:
        """The bucket's transfers, oldest first, one at a time (nothing is copied): callers may move
        the transfer they were given to another stage before asking for the next."""
        bucket = self._buckets.get((stage, category), _NO_LANES).get(lane)
        if not bucket:
            return
        orders, members = bucket
        i = 0
        while i < len(orders):
            order = orders[i]
            yield members[order]
            i = bisect.bisect_right(orders, order)  # resume after it, wherever the list moved

    def size(self, stage: Stage, category: str, lane: int) -> int:
        bucket = self._buckets.get((stage, category), _NO_LANES).get(lane)
        return len(bucket[1]) if bucket else 0

    def sizes(self, stage: Stage, category: str) -> list[tuple[int, int]]:
        """(lane, transfers) of each lane that has transfers in ``stage`` of ``category``."""
        lanes = self._buckets.get((stage, category))
        if not lanes:
            return []
        return [(lane, len(members)) for lane, (_, members) in lanes.items() if members]

    def of_category(self, category: str) -> Iterator[Transfer]:
        for (_, name), lanes in list(self._buckets.items()):
            if name == category:
                for _, members in list(lanes.values()):
                    yield from list(members.values())


_NO_LANES: dict = {}


class FifoMerge:
    """Several buckets' transfers as one stream, oldest (lowest ``order``) first.

    ``drop(lane)`` ends the streams of a lane (its device is saturated) without visiting what
    remains of them, so a step costs O((granted + streams) log streams), however many transfers
    wait on saturated lanes.
    """

    def __init__(self, streams: Iterable[tuple[int, Iterator[Transfer]]]) -> None:
        self._heap: list[tuple[int, int, Transfer, Iterator[Transfer]]] = []
        self._dropped: set[int] = set()
        for lane, stream in streams:
            self._advance(lane, stream)

    def drop(self, lane: int) -> None:
        self._dropped.add(lane)

    def __iter__(self) -> Iterator[Transfer]:
        while self._heap:
            _, lane, t, stream = heapq.heappop(self._heap)
            if lane in self._dropped:
                continue
            yield t
            if lane not in self._dropped:
                self._advance(lane, stream)

    def _advance(self, lane: int, stream: Iterator[Transfer]) -> None:
        t = next(stream, None)
        if t is not None:  # orders are unique: the tuple never compares past them
            heapq.heappush(self._heap, (t.order, lane, t, stream))
