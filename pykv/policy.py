"""The reactor's policy: which operation runs next and who owns which slot.

A pure state machine (no I/O, no threads, no clocks) driven by events from the
reactor and answering with actions for it to carry out. Each transfer moves one
storage block:

    load:     QUEUED -> OPENING -> OPENED -> READING [-> VERIFYING] -> READY -> DELIVERED -> DONE
    preload:  QUEUED -> OPENING -> OPENED -> READING [-> VERIFYING] -> READY (holds its slot)
              -> DONE when released
    joined:   JOINED (a load waiting on a preload's read) -> READY -> DELIVERED -> DONE
    store:    QUEUED -> FILLING -> FILLED -> WRITING -> DONE (``shed`` while QUEUED: CANCELLED)
    any stage -> FAILED (or CANCELLED); a held slot is released on the way

A read completes with ``read_done``, or with ``io_done`` (its I/O is over; its payload is
being verified elsewhere: VERIFYING holds the slot but no I/O depth) and later ``verified``.

Rules:
- Lanes: each transfer is on one lane (the device that holds its block; ``lanes``
  devices in all) and the I/O bounds hold per lane, so a slow device does not starve
  the others: at most ``io_depth`` reads and writes in flight on a lane; at most
  ``open_ahead`` loads of a lane opening or opened and waiting (opened blocks of a
  stalled device cannot fill the other devices' windows). Slots come from the
  ``SlotLedger`` only (shared by all lanes), so a request larger than the pool
  proceeds slot by slot.
- Priority when granting I/O and slots: ready demand reads (opened loads), then
  new demand loads and stores, then speculative preloads. Within each class,
  FIFO across lanes, except that ``urgent`` transfers (an expedited load the engine
  waits on within its step) go ahead of every other one; a saturated lane's
  transfers are passed over (not visited) and keep their place.
- Preloads (speculative reads for requests still waiting; paper section 6.5):
  at most one speculative preload opens or reads at a time per lane; it takes a
  slot only while more than ``io_depth * lanes`` slots stay free (the foreground
  keeps as many slots as it can have reads in flight) and while preloads hold fewer
  than ``max_speculative`` slots. Preloads read into ledger slots only, never a
  DRAM-tier slot, so they cannot evict DRAM entries. A READY preload keeps its slot
  until ``release``.
- Claims: a demand load of a block being preloaded ``claim``s the preload
  instead of reading the file again. A READY preload is shared at once (the
  load takes a reference on its slot and is delivered in the next batch); a
  preload still in I/O or verifying is joined (the load is delivered when the read
  completes); a preload not yet reading is promoted to demand priority (its
  speculative turn is cancelled and it is re-queued with the demand work).
  Several loads may claim one preload: one read, one ref-counted slot.
- Demand work (a read, a store's fill) that finds no free slot reclaims the slot
  of the youngest READY preload nobody is using.
- All loads that became ready in one step are delivered as one batch.
- A transfer may bring its own slot (a DRAM-tier slot outside the ledger): it then
  takes none from the ledger and gives none back; such a store is filled at once, never
  queued behind stores waiting for a ledger slot (so ``shed`` never meets it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from pykv.policy_actions import Action, Deliver, Fill, Finish, Open, Read, Write
from pykv.policy_index import CATEGORIES, FifoMerge, Kind, Stage, StageIndex, Transfer
from pykv.staging import SlotLedger

__all__ = ["Action", "Deliver", "Fill", "Finish", "Kind", "Open", "ReactorPolicy", "Read", "Stage", "Write"]

_READ_WINDOW = {Stage.OPENING, Stage.OPENED}
_SPECULATIVE_IO = {Stage.OPENING, Stage.OPENED, Stage.READING}
_CLAIMABLE = {Stage.QUEUED, Stage.OPENING, Stage.OPENED, Stage.READING, Stage.VERIFYING, Stage.READY}


@dataclass
class ReactorPolicy:
    """Decides the next operations; see the module docstring for the rules."""

    ledger: SlotLedger
    io_depth: int
    open_ahead: int
    max_speculative: int | None = None  # slots preloads may hold together (None: no limit of its own)
    lanes: int = 1  # devices, each with its own io_depth and open_ahead
    _transfers: dict[int, Transfer] = field(default_factory=dict)
    _index: StageIndex = field(default_factory=StageIndex)
    _order: itertools.count = field(default_factory=itertools.count)
    _urgent_order: itertools.count = field(default_factory=lambda: itertools.count(-(1 << 62)))
    _pending: list[Action] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.io_depth < 1 or self.open_ahead < 1 or self.lanes < 1:
            raise ValueError("io_depth, open_ahead and lanes must be >= 1")
        if self.max_speculative is not None and self.max_speculative < 0:
            raise ValueError("max_speculative must be >= 0")

    # -- events ------------------------------------------------------------------------------
    def add(self, transfer_id: int, kind: Kind, *, slot: int | None = None, urgent: bool = False,
            lane: int = 0) -> None:
        """A new transfer (FIFO within its class).

        ``slot``: a slot its caller owns (a DRAM-tier slot); the transfer uses it instead of
        taking one from the ledger and never releases it. ``urgent`` (a load): ahead of every
        transfer that is not urgent, FIFO among urgent ones. ``lane``: the device holding the
        block (``0..lanes-1``).
        """
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} is outside 0..{self.lanes - 1}")
        if urgent and kind is not Kind.LOAD:
            raise ValueError("only a load can be urgent")
        if transfer_id in self._transfers:
            raise ValueError(f"transfer {transfer_id} already exists")
        if kind is Kind.PRELOAD and slot is not None:
            raise ValueError("a preload reads into a staging slot of the ledger, never a caller's slot")
        order = next(self._urgent_order if urgent else self._order)
        self._track(Transfer(transfer_id, kind, Stage.QUEUED, slot, order, lane, brings_slot=slot is not None))

    def opened(self, transfer_id: int, ok: bool) -> None:
        t = self._expect(transfer_id, Stage.OPENING)
        if ok and t.released and not t.claimed:
            self._end(t, ok=True, stage=Stage.CANCELLED)  # released while opening: never read
        elif ok:
            t.stage = Stage.OPENED
        else:
            self._requeue_joined(t)
            self._end(t, ok=False)

    def read_done(self, transfer_id: int, ok: bool) -> None:
        """The read completed and the block was checked (``ok``) or failed."""
        self._read_finished(self._expect(transfer_id, Stage.READING), ok)

    def io_done(self, transfer_id: int) -> None:
        """The read's I/O completed; its payload is being verified: the I/O depth is free, the slot held."""
        self._expect(transfer_id, Stage.READING).stage = Stage.VERIFYING

    def verified(self, transfer_id: int, ok: bool) -> None:
        """The payload verification of a read that ended with ``io_done`` finished (``ok``) or failed."""
        self._read_finished(self._expect(transfer_id, Stage.VERIFYING), ok)

    def _read_finished(self, t: Transfer, ok: bool) -> None:
        if not ok:
            self._requeue_joined(t)
            self._end(t, ok=False)
            return
        t.stage = Stage.READY
        if t.kind is Kind.PRELOAD:
            for load in self._joined(t):
                self._share(t, load)
            if t.released:
                self._end(t, ok=True)

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

    def claim(self, preload_id: int, load_id: int) -> bool:
        """Serve new demand load ``load_id`` from preload ``preload_id`` instead of a second read.

        READY preload: the load shares its slot (one more reference) and is delivered in the
        next batch. Preload in I/O: the load joins it (JOINED until the read completes).
        Preload not yet reading: additionally promoted to demand priority. False when the
        preload is gone (released and freed, reclaimed, failed): then add the load as usual.
        A released preload still in I/O can be claimed (its read is not wasted then).
        """
        p = self._transfers.get(preload_id)
        if p is None or p.kind is not Kind.PRELOAD or p.stage not in _CLAIMABLE:
            return False
        if load_id in self._transfers:
            raise ValueError(f"transfer {load_id} already exists")
        load = self._track(Transfer(load_id, Kind.LOAD, Stage.JOINED, order=next(self._order), lane=p.lane,
                                    source=p.id))
        if p.stage is Stage.READY:
            self._share(p, load)
        else:
            p.claimed = True
        return True

    def release(self, preload_id: int) -> None:
        """Nobody waits for this preload any more: free its slot now, or once its I/O completes.

        Loads that already claimed it keep their own reference to the slot.
        """
        p = self._transfers.get(preload_id)
        if p is None or p.kind is not Kind.PRELOAD:
            return
        p.released = True
        if p.stage in (Stage.QUEUED, Stage.OPENED) and not p.claimed:
            self._end(p, ok=True, stage=Stage.CANCELLED)
        elif p.stage is Stage.READY:
            self._end(p, ok=True)

    def queued_stores(self) -> list[int]:
        """Stores waiting for a ledger slot, oldest first: what ``shed`` may drop."""
        return [t.id for t in self._in(Stage.QUEUED, category="store")]

    def shed(self, transfer_id: int) -> bool:
        """Drop a store still waiting for a slot (CANCELLED, nothing was copied); False for any
        other transfer (a store being filled or written goes on)."""
        t = self._transfers.get(transfer_id)
        if t is None or t.kind is not Kind.STORE or t.stage is not Stage.QUEUED:
            return False
        self._end(t, ok=False, stage=Stage.CANCELLED)
        return True

    # -- decisions ---------------------------------------------------------------------------
    def step(self) -> list[Action]:
        """Grant what the bounds allow, in priority order; return the actions to perform."""
        actions, self._pending = self._pending, []
        io_used = self._per_lane(Stage.READING, Stage.WRITING)
        window = self._per_lane(*_READ_WINDOW, kinds=(Kind.LOAD, Kind.PRELOAD))

        # 1. ready demand reads: opened demand loads (and claimed preloads) get I/O and a slot first
        opened = self._in(Stage.OPENED, demand=True)
        for t in opened:
            if io_used[t.lane] >= self.io_depth:
                opened.drop(t.lane)
                continue
            if not self._take_slot(t, reclaim=True):
                break
            t.stage = Stage.READING
            io_used[t.lane] += 1
            actions.append(Read(t.id, t.slot))
        # 2. new demand work: filled stores write, queued stores get slots, queued loads open
        self._advance(self._in(Stage.FILLED, Kind.STORE), io_used, self.io_depth, Stage.WRITING,
                      lambda t: Write(t.id, t.slot), actions)
        for t in self._in(Stage.QUEUED, category="store"):  # FIFO, each waiting for a ledger slot
            if not self._take_slot(t, reclaim=True):
                break
            t.stage = Stage.FILLING
            actions.append(Fill(t.id, t.slot))
        for t in self._in(Stage.QUEUED, category="store_slotted"):  # brought their slots: never wait
            t.stage = Stage.FILLING
            actions.append(Fill(t.id, t.slot))
        self._advance(self._in(Stage.QUEUED, demand=True), window, self.open_ahead, Stage.OPENING,
                      lambda t: Open(t.id), actions)
        # 3. speculative preloads: one at a time per lane, never from the foreground's reserve
        queued = self._in(Stage.QUEUED, demand=False, skip=self._speculating())
        for t in queued:
            if window[t.lane] < self.open_ahead:
                t.stage = Stage.OPENING
                window[t.lane] += 1
                actions.append(Open(t.id))
            queued.drop(t.lane)
        for t in self._in(Stage.OPENED, demand=False):
            if io_used[t.lane] < self.io_depth and self._may_speculate():
                self._take_slot(t)
                t.stage = Stage.READING
                io_used[t.lane] += 1
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

    @property
    def speculative_slots(self) -> int:
        """Slots held by preloads (reading or READY), claimed or not."""
        return sum(1 for category in CATEGORIES[Kind.PRELOAD] for t in self._index.of_category(category)
                   if t.owns_slot)

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _advance(transfers: FifoMerge, used: list[int], limit: int, stage: Stage,
                 action: Callable[[Transfer], Action], actions: list[Action]) -> None:
        """Move ``transfers`` (oldest first) on to ``stage`` while their lane has room under ``limit``
        (``used`` counts per lane); a lane that is full is skipped from then on."""
        for t in transfers:
            if used[t.lane] >= limit:
                transfers.drop(t.lane)
                continue
            t.stage = stage
            used[t.lane] += 1
            actions.append(action(t))

    def _take_slot(self, t: Transfer, *, reclaim: bool = False) -> bool:
        """Give ``t`` a slot from the ledger unless it brought its own; False if none is free.

        ``reclaim`` (demand work only): when none is free, end the youngest READY preload
        that nobody is using and take its slot.
        """
        if t.slot is not None:
            return True
        slot = self.ledger.acquire()
        if slot is None and reclaim and self._reclaim():
            slot = self.ledger.acquire()
        if slot is None:
            return False
        t.slot, t.owns_slot = slot, True
        return True

    def _track(self, t: Transfer) -> Transfer:
        self._transfers[t.id] = t
        t.index = self._index
        self._index.add(t)
        return t

    def _reclaim(self) -> bool:
        idle = [t for t in self._in(Stage.READY, Kind.PRELOAD) if t.owns_slot and self.ledger.refs(t.slot) == 1]
        if not idle:
            return False
        self._end(max(idle, key=lambda t: t.order), ok=False, stage=Stage.CANCELLED)
        return True

    def _speculating(self) -> set[int]:
        """The lanes where a speculative preload (not claimed) is opening or reading."""
        return {lane for stage in _SPECULATIVE_IO for lane, _ in self._index.sizes(stage, "speculative")}

    def _may_speculate(self) -> bool:
        if self.ledger.free <= self.io_depth * self.lanes:
            return False
        return self.max_speculative is None or self.speculative_slots < self.max_speculative

    def _share(self, preload: Transfer, load: Transfer) -> None:
        """``load`` delivers from ``preload``'s slot, holding its own reference to it."""
        self.ledger.retain(preload.slot)
        load.slot, load.owns_slot, load.stage, load.source = preload.slot, True, Stage.READY, None

    def _joined(self, preload: Transfer) -> list[Transfer]:
        """Loads waiting on ``preload``'s read (they read the same block: the same lane)."""
        return [t for t in self._index.oldest_first(Stage.JOINED, "load", preload.lane) if t.source == preload.id]

    def _requeue_joined(self, preload: Transfer) -> None:
        """The preload will not deliver: loads waiting on it read the file themselves."""
        for load in self._joined(preload):
            load.stage, load.source = Stage.QUEUED, None

    def _in(self, stage: Stage, kind: Kind | None = None, *, demand: bool | None = None,
            category: str | None = None, skip: set[int] = frozenset()) -> FifoMerge:
        """Transfers in ``stage`` in FIFO order over all lanes but ``skip``: of ``kind``, of one
        index ``category``, or loads/preloads by ``demand``."""
        if category is not None:
            categories = (category,)
        elif kind is not None:
            categories = CATEGORIES[kind]
        else:
            categories = ("load", "claimed") if demand else ("speculative",)
        return FifoMerge((lane, self._index.oldest_first(stage, c, lane)) for c in categories
                         for lane, _ in self._index.sizes(stage, c) if lane not in skip)

    def _per_lane(self, *stages: Stage, kinds: tuple[Kind, ...] = tuple(Kind)) -> list[int]:
        """Transfers in ``stages`` of ``kinds`` on each lane."""
        counts = [0] * self.lanes
        for stage in stages:
            for kind in kinds:
                for category in CATEGORIES[kind]:
                    for lane, size in self._index.sizes(stage, category):
                        counts[lane] += size
        return counts

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
