"""Where a request's blocks are, and what the scheduler answers vLLM about them: the block index.

``BlockIndex`` is the scheduler-side core object beside the worker's ``BlockStore``: it owns
the lookup state of a request, from the survey that finds its blocks to the tiers its load
comes from. Before vLLM looks a request's blocks up one by one, ``survey`` finds where each
is: a DRAM hit (``DramResidency``), a published file (``DiskPresence``: a key whose device did
not answer in time is a miss), or a miss. The first block is asked alone, since a miss there
loads nothing; the rest are asked at once. With a break-even gate, the survey also decides
whether the request's load is worth it; a refused request's lookups all miss. ``lookup``
answers from the survey of the request it was made for, ``plan_load`` pins and stamps the
hits of a load and remembers their tiers for ``load_source``. ``plan_store`` decides which
blocks of a store to write: not those in the DRAM tier or being stored, nor those on disk or
whose device did not answer in time; the rest get a DRAM slot when the tier has one free.

No vLLM, no threads of its own: the caller translates vLLM's types, and the disk is asked
through the ``Presence`` it is given (``pykv.presence.DiskPresence`` in the engine).
Counts go to the ``Metric`` and ``SchedulerCounter`` counters it is handed.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from pykv.calibration.gate import BreakEvenGate, most_reusable
from pykv.counters import Metric, SchedulerCounter
from pykv.residency import DramResidency, Tier

Groups = Sequence[tuple[int, Sequence[bytes]]]
"""Per KV group: (tokens per storage block, the request's block keys in order)."""


class Presence(Protocol):
    """The disk as the block index asks it (``pykv.presence.DiskPresence``)."""

    def find(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Per key: True when published for every rank, False when missing, None when not known in time."""

    def stamp(self, keys: Sequence[bytes]) -> int:
        """Stamp these keys' files as used now, without waiting."""


@dataclass(frozen=True)
class LoadPlan:
    """Where each block of a load comes from: its DRAM slot (a hit pinned there, or a pending slot a
    disk read is promoted into; None for neither) and whether it is a DRAM hit."""

    keys: tuple[bytes, ...]
    slots: tuple[int | None, ...]
    resident: tuple[bool, ...]


class StoreRefusal(enum.Enum):
    """Why a store writes none of its blocks (the caller's state decides; each counts its blocks)."""

    OFF = Metric.STORES_OFF  # this instance only loads (``store`` false)
    PAUSED = Metric.STORES_DISABLED  # the medium refused a store a moment ago (``StorePause``)
    OVER_LIMIT = Metric.STORES_OVER_LIMIT  # the tree stays over ``max_tree_bytes`` (the evictor is behind)


@dataclass(frozen=True)
class StorePlan:
    """What a store does with its blocks: ``keys`` to write, each with its DRAM slot (pinned,
    pending; None: no copy in DRAM), ``present`` ones skipped (in the DRAM tier, being stored or
    on disk), ``unanswered`` ones skipped (their device did not answer in time), or none written
    for a ``refused`` store."""

    keys: tuple[bytes, ...] = ()
    slots: tuple[int | None, ...] = ()
    present: tuple[bytes, ...] = ()
    unanswered: tuple[bytes, ...] = ()
    refused: StoreRefusal | None = None


class BlockIndex:
    """The scheduler's lookups, the break-even gate's decisions, load and store plans; see the module docstring.

    ``counters``: vLLM's metrics (``Metric``); ``timing``: the counter file's (``SchedulerCounter``).
    Both are the caller's to read; new ones are made when none is given.
    """

    def __init__(self, residency: DramResidency, presence: Presence, gate: BreakEvenGate | None = None, *,
                 counters: Counter[str] | None = None, timing: Counter[str] | None = None) -> None:
        self.residency, self.presence, self.gate = residency, presence, gate
        self.counters = Counter() if counters is None else counters
        self.timing = Counter() if timing is None else timing
        # where this engine's loads can come from (the gate refuses unlooked below all of their thresholds)
        self.load_tiers = (Tier.DRAM, Tier.DISK) if residency.capacity else (Tier.DISK,)
        self._refused: str | None = None  # the request whose lookups the gate answers MISS
        self._surveyed: str | None = None  # the request surveyed last, and where its blocks are:
        self._survey: dict[bytes, Tier | None] = {}  # vLLM's lookups right after reuse them
        self._planned: tuple[str | None, dict[bytes, Tier]] = (None, {})  # the last load plan's tiers

    # -- where a block is ----------------------------------------------------------------------
    def tier_of(self, key: bytes) -> Tier | None:
        """Where a load of ``key`` would come from now (None: a miss)."""
        if self.residency.slot_of(key) is not None:
            return Tier.DRAM
        return Tier.DISK if self.on_disk(key) else None

    def on_disk(self, key: bytes) -> bool:
        """Whether every rank's file of ``key`` is published (a device that does not answer in time: no)."""
        return self.presence.find([key])[0] is True

    # -- a request's survey and lookups --------------------------------------------------------
    def survey(self, req_id: str, groups: Groups, num_computed_tokens: int) -> bool:
        """Before ``req_id``'s lookups: find where each block it would load is (beyond the
        ``num_computed_tokens`` vLLM has) and, with a gate, decide whether its load is worth it.
        True when the gate refused it (its lookups then miss and vLLM recomputes)."""
        began, self.timing[SchedulerCounter.SURVEY_BEGAN_NS] = time.perf_counter(), time.time_ns()
        refused = self._surveyed_refuses(req_id, groups, num_computed_tokens)
        self.timing[SchedulerCounter.SURVEY_ENDED_NS] = time.time_ns()
        self.timing[SchedulerCounter.SURVEYS] += 1
        self.timing[SchedulerCounter.SURVEY_US] += int((time.perf_counter() - began) * 1e6)
        return refused

    def lookup(self, req_id: str, key: bytes) -> bool:
        """vLLM's lookup of one block of ``req_id``: whether it hits (from the survey when it just ran)."""
        if self._refused is not None and req_id == self._refused:
            return False
        if req_id == self._surveyed and key in self._survey:
            return self._survey[key] is not None  # surveyed just before: no second check per block
        return self.tier_of(key) is not None

    def refused(self, req_id: str) -> bool:
        """Whether the gate refused ``req_id``'s load at its last survey (and no other survey ran since)."""
        return self._refused is not None and req_id == self._refused

    def _surveyed_refuses(self, req_id: str, groups: Groups, num_computed_tokens: int) -> bool:
        self._refused = None
        self._surveyed, self._survey = req_id, {}
        tiers = self._survey
        if self.gate is not None:
            deciding = time.perf_counter()
            unlooked = self.gate.refuses_any_load_of(most_reusable(groups, num_computed_tokens), self.load_tiers)
            self.timing[SchedulerCounter.GATE_US] += int((time.perf_counter() - deciding) * 1e6)
            if unlooked:  # shorter than the threshold of every tier it has: no lookup could admit it
                return self._refuse(req_id, 0)
        self._find_tiers([key for tokens_per_block, keys in groups
                          for key in keys[num_computed_tokens // tokens_per_block:]], tiers)
        if self.gate is None:
            return False

        def tier_of(key: bytes) -> Tier | None:
            if key not in tiers:
                tiers[key] = self.tier_of(key)
            return tiers[key]

        deciding = time.perf_counter()
        decision = self.gate.decide(groups, num_computed_tokens, tier_of)
        self.timing[SchedulerCounter.GATE_US] += int((time.perf_counter() - deciding) * 1e6)
        if decision.admitted:
            return False
        return self._refuse(req_id, decision.hit_tokens)

    def _refuse(self, req_id: str, hit_tokens: int) -> bool:
        """The gate refused ``req_id``'s load (of ``hit_tokens`` found; 0 when refused unlooked)."""
        self._refused = req_id
        self.counters[Metric.GATE_REFUSALS] += 1
        self.counters[Metric.GATE_REFUSED_TOKENS] += hit_tokens
        return True

    def _find_tiers(self, keys: list[bytes], tiers: dict[bytes, Tier | None]) -> None:
        """Each of ``keys``' tier into ``tiers``: the first alone (a miss there loads nothing, so
        nothing further is looked at), then DRAM residency inline and the disk checks at once."""
        if not keys:
            return
        tiers[keys[0]] = self.tier_of(keys[0])
        if tiers[keys[0]] is None:
            return
        disk = []
        for key in dict.fromkeys(keys[1:]):
            if key in tiers:
                continue
            if self.residency.slot_of(key) is not None:
                tiers[key] = Tier.DRAM
            else:
                disk.append(key)
        for key, stored in zip(disk, self.presence.find(disk)):
            tiers[key] = Tier.DISK if stored else None

    # -- loads ---------------------------------------------------------------------------------
    def plan_load(self, req_id: str, keys: Collection[bytes]) -> LoadPlan:
        """vLLM loads these hits of ``req_id``: DRAM hits are pinned and served from their slot;
        disk hits get their files stamped (gc recency, off this thread) and, with a DRAM tier, a
        pending slot to be promoted into. Their tiers answer ``load_source`` until the next plan."""
        slots, resident, tiers, stamped = [], [], {}, []
        for key in keys:
            slot = self.residency.pin_hit(key)
            if slot is not None:
                tiers[key] = Tier.DRAM
                self.counters[Metric.HITS_DRAM] += 1
            else:
                tiers[key] = Tier.DISK
                stamped.append(key)
                self.counters[Metric.HITS_DISK] += 1
                slot = self.residency.promotion_slot(key)
            slots.append(slot)
            resident.append(tiers[key] is Tier.DRAM)
        self.presence.stamp(stamped)  # off the scheduler's step: the load needs no atime
        self._planned = (req_id, tiers)
        self.timing[SchedulerCounter.LOAD_PLANNED_NS] = time.time_ns()
        return LoadPlan(tuple(keys), tuple(slots), tuple(resident))

    def load_source(self, req_id: str, key: bytes) -> Tier | None:
        """The tier a hit of ``req_id`` is loaded from: as its load plan found it (vLLM asks right
        after planning), else where it is now (None: not found)."""
        planned_for, tiers = self._planned
        tier = tiers.get(key) if planned_for == req_id else None
        return tier or self.tier_of(key)

    # -- stores --------------------------------------------------------------------------------
    def plan_store(self, keys: Collection[bytes], refused: StoreRefusal | None = None) -> StorePlan:
        """vLLM would store these blocks: skip those the DRAM tier holds or a store in flight has,
        then ask the disk for the rest at once; a missing one is stored, through a DRAM slot when
        one is free. A ``refused`` store writes nothing and counts every block under its reason."""
        keys = list(keys)
        if refused is not None:
            self.counters[refused.value] += len(keys)
            return StorePlan(refused=refused)
        # (a key fenced by a cache reset keeps its DRAM entry until its transfer ends)
        held = [self.residency.holds(key) for key in keys]
        new = [key for key, h in zip(keys, held) if not h]
        present = [key for key, h in zip(keys, held) if h]
        self.counters[Metric.STORE_SKIPPED] += len(present)
        to_store, slots, unanswered = [], [], []
        for key, stored in zip(new, self.presence.find(new)):
            if stored is not False:  # on disk, or its device did not answer: nothing to store there now
                (present if stored else unanswered).append(key)
                self.counters[Metric.STORE_SKIPPED if stored else Metric.STORES_UNANSWERED] += 1
                continue
            to_store.append(key)
            slots.append(self.residency.begin_store(key))
        return StorePlan(tuple(to_store), tuple(slots), tuple(present), tuple(unanswered))

    def reset(self) -> None:
        """The DRAM tier was forgotten (a cache reset): the last plan's tiers no longer hold."""
        self._planned = (None, {})
