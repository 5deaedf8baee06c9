"""The reactor: one thread that owns the I/O backend and carries out the policy's actions.

Clients (the connector worker, ``pykv bench``, ``pykv warm``) submit jobs of
storage blocks from any thread. The reactor opens files ahead, reads each block
into a staging slot, checks its header (and payload checksum when asked) and
hands every block that became ready in one iteration to the ``LoadSink`` as one
batch. Stores run the other way: the ``StoreSource`` fills a slot, the reactor
writes header and payload to a temp file with O_DIRECT and publishes it.
The decisions live in ``ReactorPolicy``; this module is the mechanics.

Preloads: ``submit_preload(owner, blocks)`` reads blocks ahead for a request
that still waits (``owner``); one preload per file however many owners want it.
A later ``submit_load(..., owner=...)`` of the same file claims the preload
(shares its slot or joins its read) instead of reading it again;
``release_preloads(owner)`` drops the owner's interest, and a preload nobody
wants any more frees its slot. ``stats`` counts reads, claims and waste.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Protocol, Sequence

from pykv.errors import FormatError
from pykv.failures import BlockFailure, Step, os_failure
from pykv.format import HEADER_SIZE, BlockHeader, Geometry, build_header, decode_header, encode_header, verify_payload
from pykv.io.backend import IoBackend, IoCompletion, IoRequest, OpKind
from pykv.io.openat2 import RESOLVE_NO_SYMLINKS
from pykv.policy import Deliver, Fill, Finish, Kind, Open, Read, ReactorPolicy, Stage, Write
from pykv.staging import StagingPool
from pykv.tree import KVTree

log = logging.getLogger(__name__)

#: O_NONBLOCK: a FIFO planted at a block's name cannot block the open (the fstat after it
#: then refuses anything but a regular file); regular-file reads ignore it in preadv.
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class LoadBlock:
    """One block to load: its final path and what its header must say."""

    path: Path
    namespace: bytes
    key: bytes
    geometry: Geometry | None = None  # expected shape; None accepts what the header says
    slot: int | None = None  # a slot the caller owns (DRAM tier) to read into, instead of a pool slot


@dataclass(frozen=True)
class StoreBlock:
    """One block to store: where it goes and the shape of the payload the source will fill."""

    path: Path
    namespace: bytes
    key: bytes
    geometry: Geometry
    slot: int | None = None  # a slot the caller owns (DRAM tier) to fill and write from


@dataclass(frozen=True)
class ReadyBlock:
    """A verified block sitting in a slot; call ``Reactor.consumed(transfer)`` when done."""

    transfer: int
    job: object
    index: int
    slot: int
    header: BlockHeader


@dataclass(frozen=True)
class FillRequest:
    """Put ``length`` payload bytes of block ``index`` of ``job`` into ``slot`` after the header,
    then call ``Reactor.filled(transfer, ok)``."""

    transfer: int
    job: object
    index: int
    slot: int
    length: int


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
class _Job:
    result: JobResult
    remaining: int
    started: float
    internal: bool = False  # a preload's own job: never reported to clients


@dataclass
class _Transfer:
    job: _Job
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


@dataclass(frozen=True)
class ReactorConfig:
    io_depth: int = 16
    open_ahead: int = 32
    verify: str = "full"  # "full": header and payload checksum; "header": header only
    direct: bool = True
    max_speculative: int | None = None  # slots preloads may hold together (None: the policy's other bounds)
    read_segment: int = 0  # > 0: a block's first read goes out as parallel reads of this many bytes

    def requests_per_read(self, slot_bytes: int) -> int:
        """I/O requests one block read may keep in flight (for sizing the backend's depth)."""
        return segment_count(slot_bytes, self.read_segment)


def segment_count(length: int, segment: int) -> int:
    """Parallel reads that cover ``length`` bytes in pieces of ``segment`` (0: one read)."""
    return 1 if segment <= 0 or segment >= length else -(-length // segment)


def backend_depth(config: ReactorConfig, slot_bytes: int) -> int:
    """I/O depth a backend needs for a reactor with ``config`` (reads, opens, writes, closes in flight)."""
    return 2 * (config.io_depth * config.requests_per_read(slot_bytes) + config.open_ahead) + 8


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


class Reactor:
    """Runs the I/O pipeline on its own thread; all public methods are thread-safe."""

    def __init__(self, backend: IoBackend, pool: StagingPool, tree: KVTree, *, config: ReactorConfig | None = None,
                 sink: LoadSink | None = None, source: StoreSource | None = None,
                 on_job_done: Callable[[JobResult], None] | None = None) -> None:
        self.config = config or ReactorConfig()
        if self.config.verify not in ("full", "header"):
            raise ValueError(f"verify must be 'full' or 'header', got {self.config.verify!r}")
        segment = self.config.read_segment
        if segment < 0 or segment % 4096:
            raise ValueError(f"read_segment must be a multiple of 4096 bytes (or 0), got {segment}")
        pieces = self.config.requests_per_read(pool.slot_bytes)
        if pieces > 1 and backend.depth < self.config.io_depth * pieces + self.config.open_ahead:
            raise ValueError(f"backend depth {backend.depth} is too small for {self.config.io_depth} reads of "
                             f"{pieces} pieces; use backend_depth()")
        self.backend, self.pool, self.tree = backend, pool, tree
        self.sink, self.source, self.on_job_done = sink, source, on_job_done
        self._staged = getattr(source, "staged", None)  # StoreSource's optional hook
        self.policy = ReactorPolicy(pool.ledger, self.config.io_depth, self.config.open_ahead,
                                    max_speculative=self.config.max_speculative)
        self._preloads: dict[str, int] = {}  # block path -> its live preload transfer
        self.stats: Counter[str] = Counter({name: 0 for name in STATS})  # written by the reactor thread only
        self._direct = os.O_DIRECT if self.config.direct else 0
        self._clear_nonblock = backend.name == "io_uring"
        self._root_prefix = os.path.join(os.fspath(tree.root), "")
        self._real_root_prefix = os.path.join(os.path.realpath(tree.root), "")  # symlinks above the root are fine
        self._transfers: dict[int, _Transfer] = {}
        self._next_id = 0
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._finished: list[JobResult] = []
        self._done = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pykv-reactor", daemon=True)
        self._thread.start()

    # -- client API (any thread) -----------------------------------------------------------
    def submit_load(self, job: object, blocks: Sequence[LoadBlock], *, owner: Hashable | None = None,
                    urgent: bool = False) -> None:
        """Load ``blocks``; a block being preloaded is served by its preload (one read).
        ``owner``: the request the job belongs to; its interest in those preloads ends.
        ``urgent``: the caller waits for it now: its blocks go ahead of all other work."""
        self._post(lambda: self._add_job(job, Kind.LOAD, blocks, owner=owner, urgent=urgent))

    def submit_preload(self, owner: Hashable, blocks: Sequence[LoadBlock]) -> None:
        """Read ``blocks`` ahead into staging slots for ``owner`` (a request still waiting).

        Speculative work: it runs after all demand work, one read at a time, within the
        policy's slot bounds, and is never reported as a job. A block already preloaded
        gains ``owner`` as one more interested party (one read, one slot).
        """
        self._post(lambda: self._add_preloads(owner, blocks))

    def release_preloads(self, owner: Hashable) -> None:
        """``owner`` no longer needs its preloads (scheduled, finished or aborted)."""
        self._post(lambda: self._release_preloads(owner))

    def submit_store(self, job: object, blocks: Sequence[StoreBlock]) -> None:
        self._post(lambda: self._add_job(job, Kind.STORE, blocks))

    def consumed(self, transfer: int) -> None:
        """The consumer is done with a delivered slot."""
        self._post(lambda: self.policy.consumed(transfer))

    def filled(self, transfer: int, ok: bool = True) -> None:
        """The source finished (or failed) filling a store's slot."""
        self._post(lambda: self._on_filled(transfer, ok))

    def take_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call (none are kept with ``on_job_done``)."""
        with self._done:
            results, self._finished = self._finished, []
        return results

    def wait_for(self, job: object, timeout: float | None = None) -> JobResult:
        """Block until ``job`` finishes and return (and remove) its result (not with ``on_job_done``)."""
        if self.on_job_done is not None:
            raise RuntimeError("results go to on_job_done; wait_for has nothing to wait on")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            while True:
                for i, result in enumerate(self._finished):
                    if result.job == job:
                        return self._finished.pop(i)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"job {job!r} did not finish in {timeout} s")
                self._done.wait(remaining)

    def close(self) -> None:
        """Finish in-flight work, stop the thread and close the backend."""
        self._post(self._stop)
        self._thread.join()
        self.backend.close()

    # -- reactor thread ------------------------------------------------------------------------
    def _post(self, command: Callable[[], None]) -> None:
        self._inbox.append(command)
        self.backend.wake()

    def _stop(self) -> None:
        self._stopping = True

    def _run(self) -> None:
        while True:
            while self._inbox:
                self._inbox.popleft()()
            self._perform(self.policy.step())
            self._note_high_water()
            if self._stopping and self.backend.in_flight == 0 and not self._inbox:
                return
            if self._inbox:
                continue
            for completion in self.backend.wait(min_completions=1, timeout=None if not self._stopping else 0.05):
                self._complete(completion)

    def _add_job(self, job: object, kind: Kind, blocks: Sequence[LoadBlock | StoreBlock],
                 owner: Hashable | None = None, urgent: bool = False) -> None:
        state = _Job(JobResult(job, kind, len(blocks)), len(blocks), time.monotonic())
        if not blocks:
            self._finish_job(state)
        for index, block in enumerate(blocks):
            self._next_id += 1
            self._transfers[self._next_id] = _Transfer(state, index, block)
            if kind is Kind.LOAD and self._claim(self._next_id, block, owner):
                continue
            self.policy.add(self._next_id, kind, slot=block.slot, urgent=urgent)

    # -- preloads --------------------------------------------------------------------------------
    def _add_preloads(self, owner: Hashable, blocks: Sequence[LoadBlock]) -> None:
        for block in blocks:
            if block.slot is not None:
                raise ValueError(f"{block.path}: a preload reads into a staging slot, not a caller's slot")
            path = os.fspath(block.path)
            tid = self._preloads.get(path)
            if tid is not None:
                self._transfers[tid].owners.add(owner)
                continue
            self._next_id += 1
            job = _Job(JobResult(("preload", path), Kind.PRELOAD, 1), 1, time.monotonic(), internal=True)
            self._transfers[self._next_id] = _Transfer(job, 0, block, owners={owner})
            self._preloads[path] = self._next_id
            self.policy.add(self._next_id, Kind.PRELOAD)
            self.stats["preloads_submitted"] += 1

    def _release_preloads(self, owner: Hashable) -> None:
        for tid in list(self._preloads.values()):
            owners = self._transfers[tid].owners
            if owner in owners:
                owners.discard(owner)
                if not owners:
                    self.policy.release(tid)

    def _claim(self, tid: int, block: LoadBlock, owner: Hashable | None) -> bool:
        """Serve load transfer ``tid`` from a live preload of the same file, if there is one.

        A load into its own (DRAM-tier) slot claims it too: the block is copied from the
        preload's slot into that slot when delivered (``_deliver``), so it is promoted into the
        DRAM tier without a second read."""
        preload = self._preloads.get(os.fspath(block.path))
        if preload is None:
            return False
        in_flight = self.policy.stage(preload) is not Stage.READY
        if not self.policy.claim(preload, tid):
            return False
        p = self._transfers[preload]
        p.claims += 1
        self.stats["preloads_claimed"] += 1
        self.stats["preloads_joined"] += in_flight
        if owner is not None and owner in p.owners:
            p.owners.discard(owner)
            if not p.owners:
                self.policy.release(preload)
        return True

    def _note_high_water(self) -> None:
        ledger = self.pool.ledger
        held = ledger.num_slots - ledger.reserved - ledger.free
        if held > self.stats["slots_high"]:
            self.stats["slots_high"] = held
        if self._preloads:
            speculative = self.policy.speculative_slots
            if speculative > self.stats["preload_slots_high"]:
                self.stats["preload_slots_high"] = speculative

    def _perform(self, actions: list) -> None:
        requests: list[IoRequest] = []
        for action in actions:
            if isinstance(action, Open):
                t = self._transfers[action.transfer]
                requests.append(IoRequest(OpKind.OPEN, ("open", action.transfer), **self._open_path(t.block.path),
                                          flags=READ_FLAGS | self._direct))
            elif isinstance(action, Read):
                t = self._transfers[action.transfer]
                t.slot = action.slot
                self.stats["disk_reads"] += 1
                self.stats["preloads_started"] += t.owners is not None
                requests.extend(self._first_reads(action.transfer, t))
            elif isinstance(action, Fill):
                self._request_fill(action)
            elif isinstance(action, Write):
                request = self._start_write(action.transfer)
                if request is not None:
                    requests.append(request)
            elif isinstance(action, Deliver):
                self._deliver(action)
            elif isinstance(action, Finish):
                self._on_finish(action)
        if requests:
            self.backend.submit(requests)

    def _read_request(self, tid: int, t: _Transfer) -> IoRequest:
        length = self.pool.slot_bytes - t.done
        return IoRequest(OpKind.READ, ("read", tid), fd=t.fd, address=self.pool.address(t.slot) + t.done,
                         length=length, offset=t.done)

    def _first_reads(self, tid: int, t: _Transfer) -> list[IoRequest]:
        """The first read of a block: one request for the whole slot, or ``read_segment``-sized pieces in
        parallel (media such as loop devices read faster with more, smaller requests in flight)."""
        size, segment = self.pool.slot_bytes, self.config.read_segment
        count = segment_count(size, segment)
        if count == 1:
            return [self._read_request(tid, t)]
        t.segments = [None] * count
        base = self.pool.address(t.slot)
        return [IoRequest(OpKind.READ, ("segment", tid, i), fd=t.fd, address=base + i * segment,
                          length=min(segment, size - i * segment), offset=i * segment) for i in range(count)]

    def _write_request(self, tid: int, t: _Transfer) -> IoRequest:
        return IoRequest(OpKind.WRITE, ("write", tid), fd=t.fd, address=self.pool.address(t.slot) + t.done,
                         length=t.expected - t.done, offset=t.done)

    def _complete(self, completion: IoCompletion) -> None:
        op, tid, *part = completion.token
        result = completion.result
        if op == "close":
            if result < 0:
                log.warning("close failed: %s", os.strerror(-result))
            return
        t = self._transfers[tid]
        if op == "open":
            self._on_opened(tid, t, result)
        elif op == "read":
            self._on_read(tid, t, result)
        elif op == "segment":
            self._on_segment(tid, t, part[0], result)
        elif op == "wopen":
            self._on_write_opened(tid, t, result)
        elif op == "write":
            self._on_wrote(tid, t, result)
        elif op == "fsync":
            self._on_synced(tid, t, result)

    # -- loads -----------------------------------------------------------------------------------
    def _on_opened(self, tid: int, t: _Transfer, result: int) -> None:
        if result >= 0:
            error = self._check_opened(result, t)
            if error is not None:
                os.close(result)
                result = -error
        if result < 0:
            self._fail(t, os_failure(Step.OPEN, result))
            self.policy.opened(tid, ok=False)
            return
        t.fd = result
        self.policy.opened(tid, ok=True)

    def _check_opened(self, fd: int, t: _Transfer) -> int | None:
        """The block's one fstat, right after its open: anything but a regular file (a planted
        FIFO, device or directory) fails before any read (an errno). io_uring would hand the
        O_NONBLOCK of the open to its reads (EAGAIN where a filesystem cannot read without
        blocking), so that backend clears it here; preadv ignores it on regular files."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return errno.EINVAL if not stat.S_ISDIR(st.st_mode) else errno.EISDIR
            if self._clear_nonblock:
                fcntl.fcntl(fd, fcntl.F_SETFL, self._direct)
        except OSError as exc:
            return exc.errno or errno.EIO
        t.size = st.st_size
        return None

    def _on_segment(self, tid: int, t: _Transfer, index: int, result: int) -> None:
        """One piece of a split first read; when all are back, continue as after one read of their
        contiguous prefix (a short piece before the end is re-read from there, like a short read)."""
        assert t.segments is not None
        t.segments[index] = result
        if any(r is None for r in t.segments):
            return
        segment, results, t.segments = self.config.read_segment, t.segments, None
        errors = [r for r in results if r is not None and r < 0]
        contiguous = 0
        for i, r in enumerate(results):
            assert r is not None
            if r < 0:
                break
            contiguous += r
            if r < min(segment, self.pool.slot_bytes - i * segment):
                break
        if errors and contiguous < HEADER_SIZE:
            self._on_read(tid, t, errors[0])
        else:
            self._on_read(tid, t, contiguous)

    def _on_read(self, tid: int, t: _Transfer, result: int) -> None:
        error = None
        if result < 0:
            error = os_failure(Step.READ, result)
        else:
            t.done += result
            try:
                if t.header is None and t.done >= HEADER_SIZE:
                    t.header = self._check_header(t)
                    t.expected = t.header.file_size
                    self._check_size(t)
                if result > 0 and (t.header is None or t.done < t.expected):
                    self.backend.submit([self._read_request(tid, t)])  # short read: continue
                    return
                if t.header is None or t.done < t.expected:
                    raise FormatError(t.block.path, f"truncated: {t.done} bytes")
                if self.config.verify == "full":
                    verify_payload(t.header, self.pool.payload_view(t.slot, t.header.payload_length),
                                   path=t.block.path)
            except FormatError as exc:
                error = BlockFailure(Step.CHECK, detail=exc.reason)
        self._close(t)
        self.stats["disk_read_bytes"] += t.done
        if error is not None:
            self._fail(t, error)
        else:
            t.read_ok = True
            t.job.result.bytes += t.expected
        self.policy.read_done(tid, ok=error is None)

    def _check_header(self, t: _Transfer) -> BlockHeader:
        return slot_header(self.pool, t.slot, t.block)

    def _check_size(self, t: _Transfer) -> None:
        """The file must be exactly as long as its header says (its fstat at open: no I/O)."""
        size = t.size
        if size != t.expected:
            kind = "truncated" if size < t.expected else "oversized"
            raise FormatError(t.block.path, f"{kind}: {size} bytes, header says {t.expected}")

    def _deliver(self, action: Deliver) -> None:
        batch = []
        for tid, slot in action.blocks:
            t = self._transfers[tid]
            if t.header is None:  # a preloaded block: check what the slot holds
                t.slot = slot
                try:
                    t.header = self._check_header(t)
                except FormatError as exc:
                    self._fail(t, BlockFailure(Step.CHECK, detail=exc.reason))
                    self.policy.consumed(tid)
                    continue
                t.job.result.bytes += t.header.file_size
                if t.block.slot is not None and t.block.slot != slot:  # a preload served a promotion
                    self.pool.copy_slot(slot, t.block.slot, t.header.file_size)
                    slot = t.slot = t.block.slot
            batch.append(ReadyBlock(tid, t.job.result.job, t.index, slot, t.header))
            self.stats["delivered_blocks"] += 1
            self.stats["delivered_bytes"] += t.header.file_size
        if not batch:
            return
        if self.sink is None:
            for block in batch:
                self.policy.consumed(block.transfer)
        else:
            self.sink.deliver(batch)

    # -- stores ----------------------------------------------------------------------------------
    def _request_fill(self, action: Fill) -> None:
        t = self._transfers[action.transfer]
        t.slot = action.slot
        request = FillRequest(action.transfer, t.job.result.job, t.index, action.slot,
                              t.block.geometry.payload_length)
        if self.source is None:
            self._on_filled(action.transfer, False)
        else:
            self.source.fill([request])

    def _on_filled(self, tid: int, ok: bool) -> None:
        t = self._transfers[tid]
        if not ok:
            self._fail(t, BlockFailure(Step.FILL, detail="the source could not fill the slot"))
        else:
            self._seal(t)
        self.policy.filled(tid, ok)
        if ok and self._staged is not None:
            self._staged(t.job.result.job, t.index)

    def _seal(self, t: _Transfer) -> None:
        """Put the header of a filled store block into its slot: the slot now holds the whole block."""
        block = t.block
        payload = self.pool.payload_view(t.slot, block.geometry.payload_length)
        t.header = build_header(block.namespace, block.key, block.geometry, payload)
        encode_header(t.header, self.pool.view(t.slot))
        t.expected = t.header.file_size

    def _start_write(self, tid: int) -> IoRequest | None:
        t = self._transfers[tid]
        block = t.block
        assert isinstance(block, StoreBlock) and t.header is not None  # sealed in _on_filled
        self._zero_padding(t)
        try:
            self.tree.ensure_parent(block.path)
        except OSError as exc:
            self._fail(t, os_failure(Step.MKDIR, exc))
            self.policy.written(tid, ok=False)
            return None
        t.temp = self.tree.temp_path(block.path)
        return IoRequest(OpKind.OPEN, ("wopen", tid), **self._open_path(t.temp), flags=WRITE_FLAGS | self._direct,
                         mode=self.tree.options.file_mode)

    def _open_path(self, path: Path) -> dict:
        """Path and resolve flags of an open: a file in the tree is opened under the tree's real
        root with RESOLVE_NO_SYMLINKS, so a symlink planted anywhere below the root fails (ELOOP)."""
        text = os.fspath(path)
        if text.startswith(self._root_prefix):
            return {"path": os.fsencode(self._real_root_prefix + text[len(self._root_prefix):]),
                    "resolve": RESOLVE_NO_SYMLINKS}
        return {"path": os.fsencode(text)}  # not a tree file (tools): O_NOFOLLOW on the last name only

    def _zero_padding(self, t: _Transfer) -> None:
        start = HEADER_SIZE + t.header.payload_length
        view = self.pool.view(t.slot)
        view[start:t.expected] = bytes(t.expected - start)

    def _on_write_opened(self, tid: int, t: _Transfer, result: int) -> None:
        if result < 0:
            t.temp = None  # O_EXCL: nothing of ours was created
            self._fail(t, os_failure(Step.OPEN_FOR_WRITE, result))
            self.policy.written(tid, ok=False)
            return
        t.fd = result
        self.backend.submit([self._write_request(tid, t)])

    def _on_wrote(self, tid: int, t: _Transfer, result: int) -> None:
        if result <= 0:
            failure = os_failure(Step.WRITE, result) if result else BlockFailure(Step.WRITE, detail="no progress")
            self._abandon_write(tid, t, failure)
            return
        t.done += result
        if t.done < t.expected:
            self.backend.submit([self._write_request(tid, t)])
        elif self.tree.options.fsync:
            self.backend.submit([IoRequest(OpKind.FSYNC, ("fsync", tid), fd=t.fd)])
        else:
            self._publish(tid, t)

    def _on_synced(self, tid: int, t: _Transfer, result: int) -> None:
        if result < 0:
            self._abandon_write(tid, t, os_failure(Step.FSYNC, result))
        else:
            self._publish(tid, t)

    def _publish(self, tid: int, t: _Transfer) -> None:
        self._close(t)
        assert t.temp is not None
        try:
            if self.tree.publish(t.temp, t.block.path):
                t.job.result.published += 1
            t.job.result.bytes += t.expected
        except OSError as exc:
            self._fail(t, os_failure(Step.PUBLISH, exc))
            self.policy.written(tid, ok=False)
            return
        self.policy.written(tid, ok=True)

    def _abandon_write(self, tid: int, t: _Transfer, failure: BlockFailure) -> None:
        self._close(t)
        if t.temp is not None:
            try:
                os.unlink(t.temp)
            except OSError:
                pass
        self._fail(t, failure)
        self.policy.written(tid, ok=False)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _close(self, t: _Transfer) -> None:
        if t.fd >= 0:
            self.backend.submit([IoRequest(OpKind.CLOSE, ("close", None), fd=t.fd)])
            t.fd = -1

    def _fail(self, t: _Transfer, failure: BlockFailure) -> None:
        """Record a failed block. Expected failures (a miss, a full or read-only disk) log at
        debug level: clients report them once per interval; anything else is a warning."""
        t.job.result.failed[t.index] = failure
        log.log(logging.DEBUG if failure.expected else logging.WARNING, "%s: %s", t.block.path, failure)

    def _on_finish(self, action: Finish) -> None:
        t = self._transfers.pop(action.transfer)
        if t.fd >= 0:
            self._close(t)
        if t.owners is not None:
            self._preload_ended(action.transfer, t, action.ok)
        t.job.remaining -= 1
        if t.job.remaining == 0:
            self._finish_job(t.job)

    def _preload_ended(self, tid: int, t: _Transfer, ok: bool) -> None:
        path = os.fspath(t.block.path)
        if self._preloads.get(path) == tid:
            del self._preloads[path]
        if t.read_ok and not t.claims:
            self.stats["preload_wasted_bytes"] += t.expected
        if t.read_ok and not ok:
            self.stats["preloads_reclaimed"] += 1
        elif not t.read_ok and t.job.result.failed:
            self.stats["preloads_failed"] += 1

    def _finish_job(self, job: _Job) -> None:
        if job.internal:
            return
        job.result.seconds = time.monotonic() - job.started
        if self.on_job_done is not None:
            self.on_job_done(job.result)  # the callback owns the result: nothing to keep
            return
        with self._done:
            self._finished.append(job.result)
            self._done.notify_all()
