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
    codec: str = "none"  # the ``params`` of the codec the client encodes stores with (``pykv.codec``)


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
    ``target`` (its ``BlockRef.target``). A load of a coded block: the slot holds ``length`` stored
    bytes of codec ``codec`` (its ``params``) that decode to ``decoded_length`` bytes."""

    job: object
    index: int
    slot: int
    length: int
    target: object = None
    token: object = None  # the store's handle: hand the copy back unchanged
    codec: str = "none"
    decoded_length: int | None = None


CopyDone = Callable[..., None]
"""``done(copy, ok)``; a store's may add ``stored=``: the length of the stored bytes the client left
at the start of the slot's payload, encoded with ``EngineShape.codec`` (None or absent: raw); a failed
load's may add ``failure=`` (a ``BlockFailure``; ``Step.CHECK``: stored bytes that do not decode)."""


class StoreClient(Protocol):
    def to_slots(self, copies: Sequence[SlotCopy], done: CopyDone) -> None:
        """Store: put each block's payload into its slot, raw or encoded; ``done(copy, ok[, stored])``
        once per copy, any thread."""

    def from_slots(self, copies: Sequence[SlotCopy], done: CopyDone) -> None:
        """Load: copy each slot's payload out (one batch), decoding coded ones; ``done(copy, ok)`` once
        per copy, any thread (``ok`` False for a block it cannot decode: a miss)."""

    def job_ended(self, end: JobEnd) -> None:
        """A job ended (any thread); ``end.released``: the client already had it (``store_released``)."""

    def store_released(self, release: Release) -> None:
        """A store may be considered finished now; its writes go on (reactor thread)."""
