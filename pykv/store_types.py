"""What ``BlockStore`` and its client exchange: the engine's shape, a job's blocks, slot copies,
and the client's side of the contract (``StoreClient``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from pykv.format import Geometry
from pykv.jobledger import JobEnd, Release
from pykv.namespace import Namespace


@dataclass(frozen=True)
class EngineShape:
    """What the engine knows and the configuration does not."""

    namespace: Namespace
    slot_bytes: int
    transient_slots: int  # staging slots for reads, writes and preloads
    dram_slots: int = 0  # DRAM-tier slots (0: no tier)
    rank: int = 0
    early_release: bool = False  # a store through DRAM slots ends once sealed in them (the writes go on)


@dataclass(frozen=True)
class BlockRef:
    """One block of a job: its key, its shape, and its DRAM-tier slot (``0..dram_slots-1``)
    if it has one; ``resident``: a load whose bytes already sit in that slot. ``target``: where
    the client copies the block to or from (its engine blocks); opaque to the store, it travels
    with the block and comes back in the block's ``SlotCopy``."""

    key: bytes
    geometry: Geometry | None = None
    dram_slot: int | None = None
    resident: bool = False
    target: object = None


@dataclass(frozen=True)
class SlotCopy:
    """Copy ``length`` payload bytes of block ``index`` of ``job`` between ``slot`` and the block's
    ``target`` (its ``BlockRef.target``)."""

    job: object
    index: int
    slot: int
    length: int
    target: object = None
    token: object = None  # the store's handle: hand the copy back unchanged


CopyDone = Callable[[SlotCopy, bool], None]


class StoreClient(Protocol):
    def to_slots(self, copies: Sequence[SlotCopy], done: CopyDone) -> None:
        """Store: put each block's payload into its slot; ``done(copy, ok)`` once per copy, any thread."""

    def from_slots(self, copies: Sequence[SlotCopy], done: CopyDone) -> None:
        """Load: copy each slot's payload out (one batch); ``done(copy, ok)`` once per copy, any thread."""

    def job_ended(self, end: JobEnd) -> None:
        """A job ended (any thread); ``end.released``: the client already had it (``store_released``)."""

    def store_released(self, release: Release) -> None:
        """A store may be considered finished now; its writes go on (reactor thread)."""
