"""The worker's pure job ledger: what each load or store job still holds, and how it ended.

The worker-side half of the store's ledger (the scheduler-side half is
``pykv.residency.DramResidency``). ``BlockStore`` tells it every event of a job's
blocks and acts on its answers; the ledger itself has no threads, no I/O, no vLLM
and no torch (times come from the caller's clock).

- **Routes.** A load whose blocks all sit in their DRAM-tier slots (``resident``) is
  served from them without I/O; a load with none is read from the medium; a load
  with both is *split* into those two parts, and the job ends when both have. A
  part's blocks are addressed by their index in the part; the ledger maps them
  back to the job, so a failure is reported at its place in the whole job.
- **The engine's blocks.** A load holds them until it ends; a store until every
  block is copied into a host slot (its write may still run): ``holds_engine_blocks``.
- **Early release** (when enabled): a store whose blocks all have DRAM slots ends for
  the engine once every block is sealed in its slot (``staged``); the job stays open
  until its writes end, and its end then only reports (``JobEnd.released``).
- **Failure routing** (``JobEnd``): a corrupt file read from the medium is
  quarantined; a store the medium refused pauses stores; a missing file, a failed
  read, a bad DRAM slot or a failed copy is neither. A load's failed block and every
  later block are recomputed.
- **Counters** (``WorkerCounter``): blocks by source and outcome, load-job time and
  bytes, store outcomes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pykv.counters import WorkerCounter as C
from pykv.failures import BlockFailure, Step
from pykv.policy import Kind  # a job's kind: LOAD or STORE (PRELOAD is the reactor's own)

COPY_FAILED = BlockFailure(Step.COPY)


@dataclass(frozen=True)
class Part:
    """Blocks of a job that go one way: ``indices`` into the job, served from their DRAM
    slots (``from_dram``) or through the reactor. ``id`` names the part in every event."""

    id: object
    indices: tuple[int, ...]
    from_dram: bool = False


@dataclass(frozen=True, slots=True)
class Release:
    """A store the engine may consider finished now (its writes go on). A store given up
    (``give_up_store``) names its blocks that were never filled: ``unstored`` keys, and those of
    them whose DRAM slot no write will read (``slots_done``)."""

    job: object
    bytes: int
    seconds: float
    unstored: tuple[bytes, ...] = ()
    slots_done: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class JobEnd:
    """How a job ended, decided; the store carries out ``quarantine`` and ``pause``."""

    job: object
    kind: Kind
    keys: tuple[bytes, ...]
    bytes: int
    seconds: float
    failures: dict[int, BlockFailure]  # every failed block (a failed copy included)
    quarantine: tuple[int, ...] = ()  # loads: blocks whose file is corrupt
    failed_stores: tuple[tuple[int, bool], ...] = ()  # stores: (block, its DRAM slot holds it anyway)
    pause: BlockFailure | None = None  # stores: the medium refused one; pause stores
    stores_ended: tuple[int, ...] = ()  # stores with early release: blocks whose DRAM slot is free again
    released: bool = False  # the engine already has this store (early release): only report

    @property
    def first_failed(self) -> int | None:
        """A load's first failed block: it and every later one are recomputed."""
        return min(self.failures) if self.failures else None

    @property
    def failed_keys(self) -> list[bytes]:
        return [self.keys[i] for i in sorted(self.failures)]


@dataclass
class _Job:
    id: object
    kind: Kind
    keys: tuple[bytes, ...]
    slots: tuple[int | None, ...]
    resident: tuple[bool, ...]
    started: float
    parts: int = 1
    failed: dict[int, BlockFailure] = field(default_factory=dict)
    copy_failed: set[int] = field(default_factory=set)
    bytes: int = 0
    published: int = 0
    unfilled: set[int] = field(default_factory=set)
    filled_bytes: int = 0
    staged: int = 0
    released: bool = False
    never_filled: set[int] = field(default_factory=set)  # a store given up: blocks refused their fill
    reported: set[int] = field(default_factory=set)  # blocks whose outcome a Release already named

    def holds_engine_blocks(self) -> bool:
        return self.kind is Kind.LOAD or bool(self.unfilled)


class JobLedger:
    """Open jobs, their parts and their outcomes; see the module docstring."""

    def __init__(self, *, early_release: bool = False) -> None:
        self.early_release = early_release
        self.counters: Counter[str] = Counter()
        self._jobs: dict[object, _Job] = {}
        self._parts: dict[object, tuple[_Job, tuple[int, ...]]] = {}

    # -- opening -------------------------------------------------------------------------------
    def open_load(self, job: object, keys: Sequence[bytes], slots: Sequence[int | None],
                  resident: Sequence[bool], now: float) -> list[Part]:
        """A load job; its parts, each to be served its own way (a resident block has a slot)."""
        resident = tuple(bool(r) and s is not None for r, s in zip(resident, slots))
        state = self._open(_Job(job, Kind.LOAD, tuple(keys), tuple(slots), resident, now))
        self.counters[C.LOAD_JOBS] += 1
        in_dram = tuple(i for i, r in enumerate(resident) if r)
        on_disk = tuple(i for i, r in enumerate(resident) if not r)
        if not in_dram or not on_disk:
            return [self._part(state, job, tuple(range(len(keys))), from_dram=bool(in_dram))]
        state.parts = 2
        return [self._part(state, ("dram", job), in_dram, from_dram=True),
                self._part(state, ("disk", job), on_disk, from_dram=False)]

    def open_store(self, job: object, keys: Sequence[bytes], slots: Sequence[int | None], now: float,
                   unstored: Mapping[int, BlockFailure] | None = None) -> Part:
        """A store job; its part holds the blocks to write: all but ``unstored`` (index -> why), which
        fail at once, never filled (their DRAM slot holds nothing of this rank's)."""
        unstored = dict(unstored or {})
        writes = tuple(i for i in range(len(keys)) if i not in unstored)
        state = self._open(_Job(job, Kind.STORE, tuple(keys), tuple(slots), (False,) * len(keys), now,
                                failed=unstored, copy_failed=set(unstored), unfilled=set(writes)))
        self.counters[C.STORE_JOBS] += 1
        return self._part(state, job, writes)

    def _open(self, state: _Job) -> _Job:
        if state.id in self._jobs:
            raise ValueError(f"job {state.id!r} is already open")
        self._jobs[state.id] = state
        return state

    def _part(self, state: _Job, part: object, indices: tuple[int, ...], from_dram: bool = False) -> Part:
        self._parts[part] = (state, indices)
        return Part(part, indices, from_dram)

    # -- events of a part's blocks ---------------------------------------------------------------
    def locate(self, part: object, index: int) -> tuple[object, int]:
        """(job, block index in the job) of block ``index`` of ``part``."""
        state, indices = self._parts[part]
        return state.id, indices[index]

    def copy_failed(self, part: object, index: int, failure: BlockFailure | None = None) -> None:
        """A load's block was not copied out: the copy failed, or ``failure`` (e.g. ``Step.CHECK``:
        its stored bytes do not decode, so its file is quarantined like any corrupt one)."""
        state, indices = self._parts[part]
        if failure is None:
            state.copy_failed.add(indices[index])
        else:
            state.failed.setdefault(indices[index], failure)

    def unread(self, part: object, failed: Mapping[int, BlockFailure]) -> None:
        """Blocks of a load's ``part`` (by index in it) the reactor is not given: failed already (their
        device is not known, ``pykv.holders``)."""
        state, indices = self._parts[part]
        state.failed.update({indices[i]: failure for i, failure in failed.items()})

    def filled(self, part: object, index: int, ok: bool, length: int) -> bool:
        """A store's block was copied into its slot (or not); True when the job no longer holds
        the engine's blocks."""
        state, indices = self._parts[part]
        if not ok:
            state.copy_failed.add(indices[index])
        state.unfilled.discard(indices[index])
        state.filled_bytes += length
        return not state.unfilled

    def staged(self, part: object, now: float) -> Release | None:
        """One more block of a store is whole in its slot; a ``Release`` when the engine may have
        the job now (early release: every block sealed in a DRAM slot, no copy failed)."""
        entry = self._parts.get(part)
        if entry is None:
            return None
        state = entry[0]
        state.staged += 1
        if (state.staged < len(state.keys) or not self.early_release or state.kind is not Kind.STORE
                or state.released or state.copy_failed or any(s is None for s in state.slots)):
            return None
        state.released = True
        self.counters[C.STORE_JOBS_RELEASED_EARLY] += 1
        return Release(state.id, state.filled_bytes, now - state.started)

    def give_up_store(self, part: object, refused: Sequence[int], now: float) -> Release | None:
        """A stalled store (``pykv.stall``): no fill starts for its ``refused`` blocks (by index in the part)
        any more. A ``Release`` once no block is left to fill (none: the engine had it already, or a fill
        still runs): it names the refused blocks, and the job's end will not name them again."""
        if part not in self._parts:  # it ended meanwhile
            return None
        state, indices = self._parts[part]
        for i in refused:
            if indices[i] in state.unfilled:
                state.unfilled.discard(indices[i])
                state.copy_failed.add(indices[i])
                state.never_filled.add(indices[i])
        if state.released or state.unfilled:
            return None
        state.released = True
        state.reported |= state.never_filled
        self.counters[C.STORE_JOBS_GIVEN_UP] += 1
        gone = sorted(state.never_filled)
        return Release(state.id, state.filled_bytes, now - state.started,
                       unstored=tuple(state.keys[i] for i in gone),
                       slots_done=tuple(state.keys[i] for i in gone if self.early_release and state.slots[i] is not None))

    def part_ended(self, part: object, failed: dict[int, BlockFailure], nbytes: int, now: float,
                   published: int = 0) -> JobEnd | None:
        """A part ended (``failed`` by index in the part); the job's ``JobEnd`` when it was the last."""
        state, indices = self._parts.pop(part)
        state.failed.update({indices[i]: failure for i, failure in failed.items()})
        state.bytes += nbytes
        state.published += published
        state.parts -= 1
        if state.parts:
            return None
        del self._jobs[state.id]
        return self._end_load(state, now) if state.kind is Kind.LOAD else self._end_store(state, now)

    # -- queries -------------------------------------------------------------------------------
    def is_open(self, part: object) -> bool:
        """Whether ``part`` has not ended."""
        return part in self._parts

    def holds_engine_blocks(self, jobs: Sequence[object]) -> bool:
        """Whether the engine must not reuse any of these jobs' blocks yet."""
        return any(state.holds_engine_blocks() for j in jobs if (state := self._jobs.get(j)) is not None)

    @property
    def open_jobs(self) -> int:
        """Jobs not ended (an early-released store until its writes end)."""
        return len(self._jobs)

    # -- outcomes ------------------------------------------------------------------------------
    def _end_load(self, state: _Job, now: float) -> JobEnd:
        failures = dict(state.failed)
        for i in state.copy_failed:
            failures.setdefault(i, COPY_FAILED)
        for i, resident in enumerate(state.resident):
            if i in failures:
                self.counters[C.LOAD_BLOCKS_FAILED_DRAM if resident else C.LOAD_BLOCKS_FAILED_DISK] += 1
                if failures[i].step is Step.AUTH:
                    self.counters[C.LOAD_BLOCKS_UNAUTHENTICATED] += 1
            else:
                self.counters[C.LOAD_BLOCKS_DRAM if resident else C.LOAD_BLOCKS_DISK] += 1
        seconds = now - state.started
        micros = int(seconds * 1e6)
        self.counters[C.LOAD_JOB_US] += micros
        self.counters[C.LOAD_JOB_MAX_US] = max(self.counters[C.LOAD_JOB_MAX_US], micros)
        self.counters[C.LOAD_JOB_BYTES] += state.bytes
        quarantine = tuple(i for i in sorted(failures) if failures[i].corrupt and not state.resident[i])
        return JobEnd(state.id, Kind.LOAD, state.keys, state.bytes, seconds, failures, quarantine=quarantine)

    def _end_store(self, state: _Job, now: float) -> JobEnd:
        self.counters[C.STORE_BLOCKS] += len(state.keys)
        self.counters[C.STORE_PUBLISHED] += state.published
        failed_stores, pause = [], None
        for i, failure in sorted(state.failed.items()):
            self.counters[C.STORE_BLOCKS_FAILED] += 1
            if i not in state.reported:
                failed_stores.append((i, state.slots[i] is not None and i not in state.copy_failed))
            if failure.medium_refuses_stores:
                pause = failure
        ended = tuple(i for i, s in enumerate(state.slots)
                      if s is not None and i not in state.reported) if self.early_release else ()
        return JobEnd(state.id, Kind.STORE, state.keys, state.bytes, now - state.started, dict(state.failed),
                      failed_stores=tuple(failed_stores), pause=pause, stores_ended=ended, released=state.released)
