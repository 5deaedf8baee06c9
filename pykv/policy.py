"""The reactor's policy: which operation runs next and who owns which slot.

A pure state machine (no I/O, no threads, no clocks) driven by events from the
reactor and answering with actions for it to carry out. Each transfer moves one
storage block:

    load/preload:  QUEUED -> OPENING -> OPENED -> READING -> READY -> DELIVERED -> DONE
    store:         QUEUED -> FILLING -> FILLED -> WRITING -> DONE
    any stage      -> FAILED (or CANCELLED); a held slot is released on the way

Rules:
- Bounds: at most ``io_depth`` reads and writes in flight; at most ``open_ahead``
  loads opening or opened and waiting; slots come from the ``SlotLedger`` only,
  so a request larger than the pool proceeds slot by slot.
- Priority when granting I/O and slots: ready demand reads (opened loads), then
  new demand loads and stores, then speculative preloads.
- Preloads: at most one speculative preload is active at a time, and it takes a
  slot only while more than ``io_depth`` slots stay free (foreground keeps as
  many slots as the I/O depth).
- All loads that became ready in one step are delivered as one batch.
- A transfer may bring its own slot (a DRAM-tier slot outside the ledger): it then
  takes none from the ledger and gives none back; a resident load (bytes already
  in its slot) is ready at once.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Iterable

from pykv.staging import SlotLedger


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
    DELIVERED = "delivered"
    FILLING = "filling"
    FILLED = "filled"
    WRITING = "writing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


_FINAL = {Stage.DONE, Stage.FAILED, Stage.CANCELLED}
_READ_WINDOW = {Stage.OPENING, Stage.OPENED}


@dataclass
class Transfer:
    """The policy's view of one storage-block transfer."""

    id: int
    kind: Kind
    stage: Stage = Stage.QUEUED
    slot: int | None = None
    order: int = 0
    owns_slot: bool = False  # True when the slot came from the ledger (and goes back to it)


# -- actions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Open:
    """Open the block file of load ``transfer``."""
    transfer: int


@dataclass(frozen=True)
class Read:
    """Read the opened file of ``transfer`` into ``slot``."""
    transfer: int
    slot: int


@dataclass(frozen=True)
class Fill:
    """Ask the producer to put store ``transfer``'s payload into ``slot``."""
    transfer: int
    slot: int


@dataclass(frozen=True)
class Write:
    """Write the filled slot of store ``transfer`` to a temp file and publish it."""
    transfer: int
    slot: int


@dataclass(frozen=True)
class Deliver:
    """Hand these ready loads (transfer, slot) to the consumer as one batch."""
    blocks: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Finish:
    """``transfer`` ended (``ok`` or not); its slot is already released."""
    transfer: int
    ok: bool


Action = Open | Read | Fill | Write | Deliver | Finish


@dataclass
class ReactorPolicy:
    """Decides the next operations; see the module docstring for the rules."""

    ledger: SlotLedger
    io_depth: int
    open_ahead: int
    _transfers: dict[int, Transfer] = field(default_factory=dict)
    _order: itertools.count = field(default_factory=itertools.count)
    _pending: list[Action] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.io_depth < 1 or self.open_ahead < 1:
            raise ValueError("io_depth and open_ahead must be >= 1")

    # -- events ------------------------------------------------------------------------------
    def add(self, transfer_id: int, kind: Kind, *, slot: int | None = None, resident: bool = False) -> None:
        """A new transfer (FIFO within its class).

        ``slot``: a slot its caller owns (a DRAM-tier slot); the transfer uses it instead of
        taking one from the ledger and never releases it. ``resident``: a load whose bytes
        already sit in ``slot``; it is ready at once and does no I/O.
        """
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id} already exists")
        if resident and (slot is None or kind is Kind.STORE):
            raise ValueError("a resident transfer is a load with a slot")
        stage = Stage.READY if resident else Stage.QUEUED
        self._transfers[transfer_id] = Transfer(transfer_id, kind, stage, slot, next(self._order))

    def opened(self, transfer_id: int, ok: bool) -> None:
        t = self._expect(transfer_id, Stage.OPENING)
        if ok:
            t.stage = Stage.OPENED
        else:
            self._end(t, ok=False)

    def read_done(self, transfer_id: int, ok: bool) -> None:
        t = self._expect(transfer_id, Stage.READING)
        if ok:
            t.stage = Stage.READY
        else:
            self._end(t, ok=False)

    def consumed(self, transfer_id: int) -> None:
        """The consumer finished with a delivered slot (e.g. its device copy completed)."""
        self._end(self._expect(transfer_id, Stage.DELIVERED), ok=True)

    def filled(self, transfer_id: int, ok: bool) -> None:
        t = self._expect(transfer_id, Stage.FILLING)
        if ok:
            t.stage = Stage.FILLED
        else:
            self._end(t, ok=False)

    def written(self, transfer_id: int, ok: bool) -> None:
        self._end(self._expect(transfer_id, Stage.WRITING), ok=ok)

    def cancel(self, transfer_id: int) -> bool:
        """Drop a transfer that holds no in-flight operation; False when it must finish first."""
        t = self._transfers.get(transfer_id)
        if t is None or t.stage in (Stage.OPENING, Stage.READING, Stage.FILLING, Stage.WRITING, Stage.DELIVERED):
            return False
        self._end(t, ok=False, stage=Stage.CANCELLED)
        return True

    # -- decisions ---------------------------------------------------------------------------
    def step(self) -> list[Action]:
        """Grant what the bounds allow, in priority order; return the actions to perform."""
        actions, self._pending = self._pending, []
        io_used = self._count(Stage.READING, Stage.WRITING)
        window = self._count(*_READ_WINDOW, kinds=(Kind.LOAD, Kind.PRELOAD))

        # 1. ready demand reads: opened demand loads get I/O and a slot first
        for t in self._in(Stage.OPENED, Kind.LOAD):
            if io_used >= self.io_depth or not self._take_slot(t):
                break
            t.stage = Stage.READING
            io_used += 1
            actions.append(Read(t.id, t.slot))
        # 2. new demand work: filled stores write, queued stores get slots, queued loads open
        for t in self._in(Stage.FILLED, Kind.STORE):
            if io_used >= self.io_depth:
                break
            t.stage = Stage.WRITING
            io_used += 1
            actions.append(Write(t.id, t.slot))
        for t in self._in(Stage.QUEUED, Kind.STORE):
            if not self._take_slot(t):
                break
            t.stage = Stage.FILLING
            actions.append(Fill(t.id, t.slot))
        for t in self._in(Stage.QUEUED, Kind.LOAD):
            if window >= self.open_ahead:
                break
            t.stage = Stage.OPENING
            window += 1
            actions.append(Open(t.id))
        # 3. speculative preloads: one at a time, never from the foreground's reserve
        if not self._speculating():
            for t in self._in(Stage.QUEUED, Kind.PRELOAD):
                if window < self.open_ahead:
                    t.stage = Stage.OPENING
                    actions.append(Open(t.id))
                break
        for t in self._in(Stage.OPENED, Kind.PRELOAD):
            if io_used < self.io_depth and (t.slot is not None or self.ledger.free > self.io_depth):
                self._take_slot(t)
                t.stage = Stage.READING
                io_used += 1
                actions.append(Read(t.id, t.slot))
        # deliveries: every demand load that is ready now, in one batch
        ready = list(self._in(Stage.READY, Kind.LOAD))
        if ready:
            for t in ready:
                t.stage = Stage.DELIVERED
            actions.append(Deliver(tuple((t.id, t.slot) for t in ready)))
        return actions

    # -- queries -----------------------------------------------------------------------------
    def stage(self, transfer_id: int) -> Stage:
        t = self._transfers.get(transfer_id)
        return t.stage if t else Stage.DONE

    def slot(self, transfer_id: int) -> int | None:
        return self._transfers[transfer_id].slot

    @property
    def active(self) -> int:
        """Transfers not yet finished."""
        return len(self._transfers)

    # -- internals ---------------------------------------------------------------------------
    def _take_slot(self, t: Transfer) -> bool:
        """Give ``t`` a slot from the ledger unless it brought its own; False if none is free."""
        if t.slot is not None:
            return True
        slot = self.ledger.acquire()
        if slot is None:
            return False
        t.slot, t.owns_slot = slot, True
        return True

    def _speculating(self) -> bool:
        return any(t.kind is Kind.PRELOAD and t.stage is not Stage.QUEUED for t in self._transfers.values())

    def _in(self, stage: Stage, kind: Kind) -> Iterable[Transfer]:
        matches = [t for t in self._transfers.values() if t.stage is stage and t.kind is kind]
        return sorted(matches, key=lambda t: t.order)

    def _count(self, *stages: Stage, kinds: tuple[Kind, ...] = tuple(Kind)) -> int:
        return sum(1 for t in self._transfers.values() if t.stage in stages and t.kind in kinds)

    def _expect(self, transfer_id: int, stage: Stage) -> Transfer:
        t = self._transfers.get(transfer_id)
        if t is None or t.stage is not stage:
            found = t.stage.value if t else "unknown"
            raise ValueError(f"transfer {transfer_id}: expected stage {stage.value}, found {found}")
        return t

    def _end(self, t: Transfer, *, ok: bool, stage: Stage | None = None) -> None:
        if t.owns_slot:
            self.ledger.release(t.slot)
        t.slot, t.owns_slot = None, False
        t.stage = stage or (Stage.DONE if ok else Stage.FAILED)
        del self._transfers[t.id]
        self._pending.append(Finish(t.id, ok))
