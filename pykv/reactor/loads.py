"""The reactor's load steps: open a block through the medium, read it into a slot, check it,
deliver it; and the preloads that read blocks ahead for waiting requests.

A mixin of ``Reactor`` (reactor thread only): it shares the reactor's transfers, policy,
pool, backend and medium.
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
from pykv.reactor.types import Awaiting, JobResult, JobState, LoadBlock, ReadyBlock, TransferState, segment_count, slot_header


class LoadSteps:
    """Loads and preloads; see ``pykv.reactor`` for the whole picture."""

    # -- preloads --------------------------------------------------------------------------------
    def _add_preloads(self, owner: Hashable, blocks: Sequence[LoadBlock]) -> None:
        for block in blocks:
            path = os.fspath(block.path)
            tid = self._preloads.get(path)
            if tid is not None:
                self._transfers[tid].owners.add(owner)
                continue
            self._next_id += 1
            job = JobState(JobResult(("preload", path), Kind.PRELOAD, 1), 1, time.monotonic(), internal=True)
            self._transfers[self._next_id] = TransferState(job, 0, block, owners={owner})
            self._preloads[path] = self._next_id
            self.policy.add(self._next_id, Kind.PRELOAD, lane=self.medium.lane(block.path))
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

    def _preload_ended(self, tid: int, t: TransferState, ok: bool) -> None:
        path = os.fspath(t.block.path)
        if self._preloads.get(path) == tid:
            del self._preloads[path]
        if t.read_ok and not t.claims:
            self.stats["preload_wasted_bytes"] += t.expected
        if t.read_ok and not ok:
            self.stats["preloads_reclaimed"] += 1
        elif not t.read_ok and t.job.result.failed:
            self.stats["preloads_failed"] += 1

    # -- open, read, check -----------------------------------------------------------------------
    def _open_request(self, tid: int, t: TransferState) -> IoRequest:
        spec = self.medium.open_for_read(t.block.path)
        return IoRequest(OpKind.OPEN, (Awaiting.OPEN, tid), path=spec.path, flags=spec.flags, mode=spec.mode,
                         resolve=spec.resolve)

    def _on_opened(self, tid: int, t: TransferState, result: int) -> None:
        if result >= 0:
            try:
                t.size = self.medium.check_opened(result)
            except OSError as exc:  # a planted FIFO, device or directory: refused before any read
                self.backend.submit([IoRequest(OpKind.CLOSE, (Awaiting.CLOSE, None), fd=result)])
                result = -(exc.errno or errno.EIO)
        if result < 0:
            self._fail(t, os_failure(Step.OPEN, result))
            self.policy.opened(tid, ok=False)
            return
        t.fd = result
        self.policy.opened(tid, ok=True)

    def _read_request(self, tid: int, t: TransferState) -> IoRequest:
        length = self.pool.slot_bytes - t.done
        return IoRequest(OpKind.READ, (Awaiting.READ, tid), fd=t.fd, address=self.pool.address(t.slot) + t.done,
                         length=length, offset=t.done)

    def _first_reads(self, tid: int, t: TransferState) -> list[IoRequest]:
        """The first read of a block: one request for the whole slot, or ``read_segment``-sized pieces in
        parallel (media such as loop devices read faster with more, smaller requests in flight)."""
        size, segment = self.pool.slot_bytes, self.config.read_segment
        count = segment_count(size, segment)
        if count == 1:
            return [self._read_request(tid, t)]
        t.segments = [None] * count
        base = self.pool.address(t.slot)
        return [IoRequest(OpKind.READ, (Awaiting.SEGMENT, tid, i), fd=t.fd, address=base + i * segment,
                          length=min(segment, size - i * segment), offset=i * segment) for i in range(count)]

    def _on_segment(self, tid: int, t: TransferState, index: int, result: int) -> None:
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

    def _on_read(self, tid: int, t: TransferState, result: int) -> None:
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
                    raise TruncatedError(t.block.path, t.done, t.expected if t.header is not None else None)
            except FormatError as exc:
                error = BlockFailure(Step.CHECK, detail=exc.reason)
        self._close(t)
        self.stats["disk_read_bytes"] += t.done
        if error is None and self._verify_loads:
            self._verify(tid, t)
            return
        self._read_checked(tid, t, error)

    def _verify(self, tid: int, t: TransferState) -> None:
        """Hand the payload to the verifier threads; the I/O depth is free meanwhile, the slot held."""
        self.policy.io_done(tid)
        self._hashing += 1
        payload = self.pool.payload_view(t.slot, t.header.payload_length)
        self._verifier.submit(t.header, self.pool.view(t.slot)[:HEADER_SIZE], payload, t.block.path,
                              lambda failure: self._post(lambda: self._on_verified(tid, failure)))

    def _on_verified(self, tid: int, failure: BlockFailure | None) -> None:
        self._hashing -= 1
        self._read_checked(tid, self._transfers[tid], failure, verifying=True)

    def _read_checked(self, tid: int, t: TransferState, error: BlockFailure | None, *,
                      verifying: bool = False) -> None:
        """The block's read ended: checked (``error`` None) or failed."""
        if error is not None:
            self._fail(t, error)
        else:
            t.read_ok = True
            t.job.result.bytes += t.expected
        (self.policy.verified if verifying else self.policy.read_done)(tid, ok=error is None)

    def _check_header(self, t: TransferState) -> BlockHeader:
        return slot_header(self.pool, t.slot, t.block)

    def _check_size(self, t: TransferState) -> None:
        """The file must be exactly as long as its header says (its size at open: no I/O)."""
        check_file_size(t.block.path, t.size, t.header)

    # -- delivery --------------------------------------------------------------------------------
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
