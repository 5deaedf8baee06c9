"""What clients hand the reactor and what they get back: blocks, requests, results, settings.

Also the reactor thread's own per-job and per-block state (``JobState``,
``TransferState``), shared by its load and store steps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pykv.errors import FormatError
from pykv.failures import BlockFailure
from pykv.format import HEADER_SIZE, BlockHeader, Geometry, decode_header
from pykv.policy import Kind
from pykv.staging import StagingPool


class Awaiting(enum.Enum):
    """What an I/O request's completion answers (the first item of its token; the second is the
    transfer, a ``SEGMENT``'s third its piece): the reactor dispatches completions on it."""

    OPEN = "open"
    READ = "read"
    SEGMENT = "segment"  # one piece of a split first read
    WRITE_OPEN = "open for write"
    WRITE = "write"
    FSYNC = "fsync"
    CLOSE = "close"  # nobody waits for it: a failure is logged


@dataclass(frozen=True)
class LoadBlock:
    """One block to load: its location (``Medium.locate``) and what its header must say."""

    path: Path
    namespace: bytes
    key: bytes
    geometry: Geometry | None = None  # expected shape; None accepts what the header says
    slot: int | None = None  # a slot the caller owns (DRAM tier) to read into, instead of a pool slot
    target: object = None  # the caller's: handed back in the block's ``ReadyBlock``


@dataclass(frozen=True)
class StoreBlock:
    """One block to store: its location (``Medium.locate``) and the shape of the payload the source fills."""

    path: Path
    namespace: bytes
    key: bytes
    geometry: Geometry
    slot: int | None = None  # a slot the caller owns (DRAM tier) to fill and write from
    target: object = None  # the caller's: handed back in the block's ``FillRequest``
    codec: str = "none"  # the ``params`` of the codec the source may encode the payload with (``filled``)


@dataclass(frozen=True)
class ReadyBlock:
    """A verified block sitting in a slot; call ``Reactor.consumed(transfer)`` when done."""

    transfer: int
    job: object
    index: int
    slot: int
    header: BlockHeader
    target: object = None  # the ``LoadBlock``'s


@dataclass(frozen=True)
class FillRequest:
    """Put ``length`` payload bytes of block ``index`` of ``job`` into ``slot`` after the header,
    then call ``Reactor.filled(transfer, ok)``."""

    transfer: int
    job: object
    index: int
    slot: int
    length: int
    target: object = None  # the ``StoreBlock``'s


class LoadSink(Protocol):
    def deliver(self, blocks: list[ReadyBlock]) -> None: ...


class StoreSource(Protocol):
    def fill(self, requests: list[FillRequest]) -> None: ...

    # Optional: ``staged(job, index)`` once block ``index`` of ``job`` is whole in its slot
    # (payload and header), before its write starts; a slot that the caller owns (DRAM tier)
    # can serve loads from then on.


@dataclass
class JobResult:
    """Outcome of a job: which block indices failed and why, bytes moved, wall time."""

    job: object
    kind: Kind
    blocks: int
    failed: dict[int, BlockFailure] = field(default_factory=dict)
    published: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class JobState:
    """(Reactor thread.) A job in progress."""

    result: JobResult
    remaining: int
    started: float
    internal: bool = False  # a preload's own job: never reported to clients


@dataclass
class TransferState:
    """(Reactor thread.) The mechanics' view of one block of a job (the policy keeps its own)."""

    job: JobState
    index: int
    block: LoadBlock | StoreBlock
    fd: int = -1
    slot: int = -1
    done: int = 0
    expected: int = 0
    temp: Path | None = None
    header: BlockHeader | None = None
    owners: set | None = None  # preload: the waiting requests that still want it (None: not a preload)
    claims: int = 0  # preload: demand loads it served
    read_ok: bool = False  # the block was read and verified
    segments: list[int | None] | None = None  # split first read: each piece's result (None: in flight)
    size: int = -1  # the opened file's size (its fstat right after the open)
    lane: int = 0  # the device that holds the block (``Medium.lane``): its file calls run on its threads


@dataclass(frozen=True)
class ReactorConfig:
    """The reactor's bounds and checks (how files are opened, e.g. O_DIRECT, is the medium's)."""

    io_depth: int = 16
    open_ahead: int = 32
    verify: str = "full"  # "full": header and payload checksum; "header": header only
    max_speculative: int | None = None  # slots preloads may hold together (None: the policy's other bounds)
    read_segment: int = 0  # > 0: a block's first read goes out as parallel reads of this many bytes
    verify_threads: int = 4  # threads that check payload checksums (verify="full") beside the reads

    def requests_per_read(self, slot_bytes: int) -> int:
        """I/O requests one block read may keep in flight (for sizing the backend's depth)."""
        return segment_count(slot_bytes, self.read_segment)


def segment_count(length: int, segment: int) -> int:
    """Parallel reads that cover ``length`` bytes in pieces of ``segment`` (0: one read)."""
    return 1 if segment <= 0 or segment >= length else -(-length // segment)


def backend_depth(config: ReactorConfig, slot_bytes: int, lanes: int = 1) -> int:
    """I/O depth a backend needs for a reactor with ``config`` over a medium of ``lanes`` devices
    (reads, opens, writes, closes in flight; the depth and the open window are per lane)."""
    return 2 * lanes * (config.io_depth * config.requests_per_read(slot_bytes) + config.open_ahead) + 8


STATS = ("disk_reads", "disk_read_bytes", "delivered_blocks", "delivered_bytes", "preloads_submitted",
         "preloads_started", "preloads_claimed", "preloads_joined", "preloads_reclaimed", "preloads_failed",
         "preload_wasted_bytes", "slots_high", "preload_slots_high")
"""``Reactor.stats`` counters: ``disk_reads`` block reads started (demand and preload) and
``disk_read_bytes`` their bytes; ``delivered_*`` blocks handed to the sink; ``preloads_started``
preload reads started; ``preloads_claimed`` demand loads served by a preload (``preloads_joined``
of them while its read was in flight); ``preloads_reclaimed`` READY preloads whose slot demand
took; ``preload_wasted_bytes`` bytes preloaded and never claimed; ``slots_high`` /
``preload_slots_high`` the most ledger slots held at once, by anyone / by preloads."""


def slot_header(pool: StagingPool, slot: int, block: LoadBlock) -> BlockHeader:
    """The header in ``slot``, checked against what ``block`` expects; ``FormatError`` if it differs."""
    header = decode_header(pool.view(slot)[:HEADER_SIZE], path=block.path)
    if header.namespace != block.namespace:
        raise FormatError(block.path, "header names another namespace")
    if header.key != block.key:
        raise FormatError(block.path, "header names another block key")
    if block.geometry is not None and header.geometry != block.geometry:
        raise FormatError(block.path, f"geometry {header.geometry} differs from expected {block.geometry}")
    if header.file_size > pool.slot_bytes:
        raise FormatError(block.path, f"block of {header.file_size} bytes exceeds the slot size")
    return header
