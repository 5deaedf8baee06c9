"""Jobs whose I/O stopped making progress: when to give one up, and what giving up still waits for.

Pure bookkeeping for ``BlockStore`` (no threads, no I/O; times come from the caller). A part
of a job that goes through the reactor is watched from its submission: every event of its
blocks (a block delivered or filled, a copy ended, a block staged) is progress. A part with
no progress for ``deadline`` seconds is *given up* (a stalled mount: NFS, Lustre, a FUSE
daemon that stopped): its reads and writes may never return, so the client must not wait
for them, yet the client's memory must never be touched by them later.

- **A load** given up ends for the client once no copy out of a slot is in flight (a copy
  writes into the engine's blocks): every block not copied by then failed
  (``STALLED``) and is recomputed; a block delivered later is never copied.
- **A store** given up lets the engine have its blocks once no copy into a slot is in flight:
  its blocks still waiting for a fill are refused from then on (a fill copies out of the
  engine's blocks, which the engine may have reused). Its writes go on from their slots and
  publish whole files or nothing; their end is reported as usual, whenever it comes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pykv.failures import BlockFailure, Step
from pykv.policy import Kind

STALLED = BlockFailure(Step.STALL, detail="no progress within io_deadline (a stalled mount?)")


@dataclass
class _Watch:
    kind: Kind
    blocks: int
    last: float  # the last progress
    copying: set[int] = field(default_factory=set)  # block indices with a client copy in flight
    copied: set[int] = field(default_factory=set)  # loads: blocks copied out whole
    refused: set[int] = field(default_factory=set)  # stores: blocks no fill may start for
    given_up: bool = False


class StallWatch:
    """The watched parts; see the module docstring. The caller serialises calls (its lock)."""

    def __init__(self, deadline: float) -> None:
        if not deadline > 0:
            raise ValueError(f"deadline must be positive, got {deadline}")
        self.deadline = deadline
        self._parts: dict[object, _Watch] = {}

    def __contains__(self, part: object) -> bool:
        return part in self._parts

    def watch(self, part: object, kind: Kind, blocks: int, now: float) -> None:
        self._parts[part] = _Watch(kind, blocks, now)

    def progress(self, part: object, now: float) -> None:
        watch = self._parts.get(part)
        if watch is not None:
            watch.last = now

    def given_up(self, part: object) -> bool:
        watch = self._parts.get(part)
        return watch is not None and watch.given_up

    # -- copies between the client's memory and the slots ------------------------------------------
    def may_copy(self, part: object, index: int, now: float) -> bool:
        """A copy of block ``index`` is about to start; False: it must not (the part was given up)."""
        watch = self._parts.get(part)
        if watch is None:
            return True
        if watch.given_up or index in watch.refused:
            return False
        watch.copying.add(index)
        watch.last = now
        return True

    def copy_ended(self, part: object, index: int, ok: bool, now: float) -> bool:
        """A copy ended; True when it was the last one a given-up part waited for (end it now)."""
        watch = self._parts.get(part)
        if watch is None:
            return False
        watch.copying.discard(index)
        if ok and watch.kind is Kind.LOAD:
            watch.copied.add(index)
        watch.last = now
        return watch.given_up and not watch.copying

    # -- giving up -----------------------------------------------------------------------------
    def due(self, now: float) -> list[tuple[object, Kind]]:
        """Parts with no progress for the deadline, now given up (each named once), with their kind."""
        due = [(part, watch.kind) for part, watch in self._parts.items()
               if not watch.given_up and now - watch.last >= self.deadline]
        for part, kind in due:
            watch = self._parts[part]
            watch.given_up = True
            if kind is Kind.STORE:
                watch.refused = set(range(watch.blocks)) - watch.copying
        return due

    def settled(self, part: object) -> bool:
        """A given-up part no copy is in flight for: the client may have it now."""
        watch = self._parts.get(part)
        return watch is not None and watch.given_up and not watch.copying

    def load_failures(self, part: object) -> dict[int, BlockFailure]:
        """A given-up load's blocks that were not copied out whole."""
        watch = self._parts[part]
        return {index: STALLED for index in range(watch.blocks) if index not in watch.copied}

    def refused(self, part: object) -> set[int]:
        """A given-up store's blocks no fill may start for."""
        watch = self._parts.get(part)
        return set() if watch is None else set(watch.refused)

    def forget(self, part: object) -> None:
        """The part's end arrived (its reactor job ended): nothing more to watch."""
        self._parts.pop(part, None)

    @property
    def watched(self) -> int:
        return len(self._parts)
