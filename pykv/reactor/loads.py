"""The reactor's load steps: open a block through the medium, read it into a slot, check it,
deliver it; and the preloads that read blocks ahead for waiting requests.

``Loads`` runs on the reactor thread only; the ``Reactor`` (``pykv.reactor.core``) calls it for
the policy's ``Open``, ``Read`` and ``Deliver`` actions and the completions of its requests.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Hashable, Sequence

from pykv.errors import FormatError
from pykv.failures import BlockFailure, Step, os_failure
from pykv.format import HEADER_SIZE, BlockHeader, TruncatedError, check_file_size
from pykv.io.backend import IoRequest, OpKind
from pykv.policy import Deliver, Kind, Stage
from pykv.reactor.context import ReactorContext
from pykv.reactor.fileops import Outcome
from pykv.reactor.types import (Awaiting, JobResult, JobState, LoadBlock, LoadSink, ReadyBlock, TransferState,
                                segment_count, slot_header)


class Loads:
    """Loads and preloads; see ``pykv.reactor.core`` for the whole picture.

    Uses the context's backend, pool, medium, policy, verifier, files, transfers, stats, ``hashing``,
    ``post``, ``close`` and ``fail``; ``sink`` takes the ready blocks (None: each is consumed at once),
    ``read_segment`` splits a first read (``ReactorConfig``), ``verify`` hashes each payload
    (checksum or MAC) before the block counts as read."""

    def __init__(self, context: ReactorContext, sink: LoadSink | None, *, read_segment: int, verify: bool) -> None:
        self._ctx = context
        self._backend, self._pool, self._medium, self._policy = (context.backend, context.pool, context.medium,
                                                                 context.policy)
        self._verifier, self._transfers, self._stats = context.verifier, context.transfers, context.stats
        self._sink = sink
        self._read_segment = read_segment
        self._verify_loads = verify
        self._preloads: dict[str, int] = {}  # block path -> its live preload transfer

    @property
    def preloading(self) -> bool:
        """Some preload is live (read, reading or waiting)."""
        return bool(self._preloads)

    # -- preloads --------------------------------------------------------------------------------
    def add_preloads(self, owner: Hashable, blocks: Sequence[LoadBlock]) -> None:
        for block in blocks:
            path = os.fspath(block.path)
            tid = self._preloads.get(path)
            if tid is not None:
                self._transfers[tid].owners.add(owner)
                continue
            job = JobState(JobResult(("preload", path), Kind.PRELOAD, 1), 1, time.monotonic(), internal=True)
            lane = self._medium.lane(block.path)
            tid = self._ctx.add_transfer(TransferState(job, 0, block, owners={owner}, lane=lane))
            self._preloads[path] = tid
            self._policy.add(tid, Kind.PRELOAD, lane=lane)
            self._stats["preloads_submitted"] += 1

    def release_preloads(self, owner: Hashable) -> None:
        for tid in list(self._preloads.values()):
            owners = self._transfers[tid].owners
            if owner in owners:
                owners.discard(owner)
                if not owners:
                    self._policy.release(tid)

    def claim(self, tid: int, block: LoadBlock, owner: Hashable | None) -> bool:
        """Serve load transfer ``tid`` from a live preload of the same file, if there is one.

        A load into its own (DRAM-tier) slot claims it too: the block is copied from the
        preload's slot into that slot when delivered (``deliver``), so it is promoted into the
        DRAM tier without a second read."""
        preload = self._preloads.get(os.fspath(block.path))
        if preload is None:
            return False
        in_flight = self._policy.stage(preload) is not Stage.READY
        if not self._policy.claim(preload, tid):
            return False
        p = self._transfers[preload]
        p.claims += 1
        self._stats["preloads_claimed"] += 1
        self._stats["preloads_joined"] += in_flight
        if owner is not None and owner in p.owners:
            p.owners.discard(owner)
            if not p.owners:
                self._policy.release(preload)
        return True

    def preload_ended(self, tid: int, t: TransferState, ok: bool) -> None:
        path = os.fspath(t.block.path)
        if self._preloads.get(path) == tid:
            del self._preloads[path]
        if t.read_ok and not t.claims:
            self._stats["preload_wasted_bytes"] += t.expected
        if t.read_ok and not ok:
            self._stats["preloads_reclaimed"] += 1
        elif not t.read_ok and t.job.result.failed:
            self._stats["preloads_failed"] += 1

    # -- open, read, check -----------------------------------------------------------------------
    def open_request(self, tid: int) -> IoRequest:
        """The policy lets transfer ``tid`` open its file: the open, as the medium spells it."""
        spec = self._medium.open_for_read(self._transfers[tid].block.path)
        return IoRequest(OpKind.OPEN, (Awaiting.OPEN, tid), path=spec.path, flags=spec.flags, mode=spec.mode,
                         resolve=spec.resolve)

    def on_opened(self, tid: int, t: TransferState, result: int) -> None:
        """The open ended: an opened file is checked by the medium on its device's threads first."""
        if result >= 0:
            self._ctx.files.run(t.lane, lambda: self._medium.check_opened(result),
                                lambda outcome: self._checked(tid, t, result, outcome))
            return
        self._opened(tid, t, result)

    def _checked(self, tid: int, t: TransferState, fd: int, outcome: Outcome[int]) -> None:
        """The medium's check of the opened file (``check_opened``) came back."""
        try:
            t.size = outcome.get()
        except OSError as exc:  # a planted FIFO, device or directory: refused before any read
            self._backend.submit([IoRequest(OpKind.CLOSE, (Awaiting.CLOSE, None), fd=fd)])
            self._opened(tid, t, -(exc.errno or errno.EIO))
            return
        self._opened(tid, t, fd)

    def _opened(self, tid: int, t: TransferState, result: int) -> None:
        if result < 0:
            self._ctx.fail(t, os_failure(Step.OPEN, result))
            self._policy.opened(tid, ok=False)
            return
        t.fd = result
        self._policy.opened(tid, ok=True)

    def _read_request(self, tid: int, t: TransferState) -> IoRequest:
        length = self._pool.slot_bytes - t.done
        return IoRequest(OpKind.READ, (Awaiting.READ, tid), fd=t.fd, address=self._pool.address(t.slot) + t.done,
                         length=length, offset=t.done)

    def start_read(self, tid: int, slot: int) -> list[IoRequest]:
        """The policy granted transfer ``tid`` a read into ``slot``: the requests of its first read."""
        t = self._transfers[tid]
        t.slot = slot
        self._stats["disk_reads"] += 1
        self._stats["preloads_started"] += t.owners is not None
        return self._first_reads(tid, t)

    def _first_reads(self, tid: int, t: TransferState) -> list[IoRequest]:
        """The first read of a block: one request for the whole slot, or ``read_segment``-sized pieces in
        parallel (media such as loop devices read faster with more, smaller requests in flight)."""
        size, segment = self._pool.slot_bytes, self._read_segment
        count = segment_count(size, segment)
        if count == 1:
            return [self._read_request(tid, t)]
        t.segments = [None] * count
        base = self._pool.address(t.slot)
        return [IoRequest(OpKind.READ, (Awaiting.SEGMENT, tid, i), fd=t.fd, address=base + i * segment,
                          length=min(segment, size - i * segment), offset=i * segment) for i in range(count)]

    def on_segment(self, tid: int, t: TransferState, index: int, result: int) -> None:
        """One piece of a split first read; when all are back, continue as after one read of their
        contiguous prefix (a short piece before the end is re-read from there, like a short read)."""
        assert t.segments is not None
        t.segments[index] = result
        if any(r is None for r in t.segments):
            return
        segment, results, t.segments = self._read_segment, t.segments, None
        errors = [r for r in results if r is not None and r < 0]
        contiguous = 0
        for i, r in enumerate(results):
            assert r is not None
            if r < 0:
                break
            contiguous += r
            if r < min(segment, self._pool.slot_bytes - i * segment):
                break
        if errors and contiguous < HEADER_SIZE:
            self.on_read(tid, t, errors[0])
        else:
            self.on_read(tid, t, contiguous)

    def on_read(self, tid: int, t: TransferState, result: int) -> None:
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
                    self._backend.submit([self._read_request(tid, t)])  # short read: continue
                    return
                if t.header is None or t.done < t.expected:
                    raise TruncatedError(t.block.path, t.done, t.expected if t.header is not None else None)
            except FormatError as exc:
                error = BlockFailure(Step.CHECK, detail=exc.reason)
        self._ctx.close(t)
        self._stats["disk_read_bytes"] += t.done
        if error is None and self._verify_loads:
            self._verify(tid, t)
            return
        self._read_checked(tid, t, error)

    def _verify(self, tid: int, t: TransferState) -> None:
        """Hand the payload to the verifier threads; the I/O depth is free meanwhile, the slot held."""
        self._policy.io_done(tid)
        self._ctx.hashing += 1
        payload = self._pool.payload_view(t.slot, t.header.payload_length)
        self._verifier.submit(t.header, self._pool.view(t.slot)[:HEADER_SIZE], payload, t.block.path,
                              lambda failure: self._ctx.post(lambda: self._on_verified(tid, failure)))

    def _on_verified(self, tid: int, failure: BlockFailure | None) -> None:
        self._ctx.hashing -= 1
        self._read_checked(tid, self._transfers[tid], failure, verifying=True)

    def _read_checked(self, tid: int, t: TransferState, error: BlockFailure | None, *,
                      verifying: bool = False) -> None:
        """The block's read ended: checked (``error`` None) or failed."""
        if error is not None:
            self._ctx.fail(t, error)
        else:
            t.read_ok = True
            t.job.result.bytes += t.expected
        (self._policy.verified if verifying else self._policy.read_done)(tid, ok=error is None)

    def _check_header(self, t: TransferState) -> BlockHeader:
        return slot_header(self._pool, t.slot, t.block)

    def _check_size(self, t: TransferState) -> None:
        """The file must be exactly as long as its header says (its size at open: no I/O)."""
        check_file_size(t.block.path, t.size, t.header)

    # -- delivery --------------------------------------------------------------------------------
    def deliver(self, action: Deliver) -> None:
        batch = []
        for tid, slot in action.blocks:
            t = self._transfers[tid]
            if t.header is None:  # a preloaded block: check what the slot holds
                t.slot = slot
                try:
                    t.header = self._check_header(t)
                except FormatError as exc:
                    self._ctx.fail(t, BlockFailure(Step.CHECK, detail=exc.reason))
                    self._policy.consumed(tid)
                    continue
                t.job.result.bytes += t.header.file_size
                if t.block.slot is not None and t.block.slot != slot:  # a preload served a promotion
                    self._pool.copy_slot(slot, t.block.slot, t.header.file_size)
                    slot = t.slot = t.block.slot
            batch.append(ReadyBlock(tid, t.job.result.job, t.index, slot, t.header, t.block.target))
            self._stats["delivered_blocks"] += 1
            self._stats["delivered_bytes"] += t.header.file_size
        if not batch:
            return
        if self._sink is None:
            for block in batch:
                self._policy.consumed(block.transfer)
        else:
            self._sink.deliver(batch)
