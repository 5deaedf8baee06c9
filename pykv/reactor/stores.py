"""The reactor's store steps: the source fills a slot, the verifier threads seal it (header with
the payload's checksum in front of the payload; with a key ring, signed), the reactor writes it to the medium's
temporary file and has the medium publish it.

A mixin of ``Reactor`` (reactor thread only): it shares the reactor's transfers, policy,
pool, backend and medium.
"""

from __future__ import annotations

from pykv.failures import BlockFailure, Step, os_failure
from pykv.format import HEADER_SIZE, BlockHeader
from pykv.io.backend import IoRequest, OpKind
from pykv.policy import Fill
from pykv.reactor.types import Awaiting, FillRequest, StoreBlock, TransferState


class StoreSteps:
    """Stores; see ``pykv.reactor`` for the whole picture."""

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
            self._sealed(tid, t, None)
            return
        head = self.pool.view(t.slot)[:HEADER_SIZE]
        payload = self.pool.payload_view(t.slot, t.block.geometry.payload_length)
        self._hashing += 1  # checksum (and MAC): on the verifier threads, beside the I/O of other blocks
        self._verifier.seal(t.block, head, payload, lambda header: self._post(lambda: self._on_signed(tid, header)))

    def _on_signed(self, tid: int, header: BlockHeader | None) -> None:
        self._hashing -= 1
        t = self._transfers[tid]
        if header is None:
            self._fail(t, BlockFailure(Step.FILL, detail="signing the block failed"))
        self._sealed(tid, t, header)

    def _sealed(self, tid: int, t: TransferState, header: BlockHeader | None) -> None:
        """The slot of a filled store holds the whole block, header in front (``header`` None: failed)."""
        if header is not None:
            t.header, t.expected = header, header.file_size
        self.policy.filled(tid, header is not None)
        if header is not None and self._staged is not None:
            self._staged(t.job.result.job, t.index)

    def _start_write(self, tid: int) -> IoRequest | None:
        """The open of the block's temporary file (None when the medium refused the store)."""
        t = self._transfers[tid]
        block = t.block
        assert isinstance(block, StoreBlock) and t.header is not None  # sealed in _on_filled
        self._zero_padding(t)
        try:
            target = self.medium.prepare_write(block.path)
        except OSError as exc:
            self._fail(t, os_failure(Step.MKDIR, exc))
            self.policy.written(tid, ok=False)
            return None
        t.temp, spec = target.temp, target.open
        return IoRequest(OpKind.OPEN, (Awaiting.WRITE_OPEN, tid), path=spec.path, flags=spec.flags, mode=spec.mode,
                         resolve=spec.resolve)

    def _zero_padding(self, t: TransferState) -> None:
        start = HEADER_SIZE + t.header.payload_length
        view = self.pool.view(t.slot)
        view[start:t.expected] = bytes(t.expected - start)

    def _write_request(self, tid: int, t: TransferState) -> IoRequest:
        return IoRequest(OpKind.WRITE, (Awaiting.WRITE, tid), fd=t.fd, address=self.pool.address(t.slot) + t.done,
                         length=t.expected - t.done, offset=t.done)

    def _on_write_opened(self, tid: int, t: TransferState, result: int) -> None:
        if result < 0:
            t.temp = None  # an exclusive create: nothing of ours was created
            self._fail(t, os_failure(Step.OPEN_FOR_WRITE, result))
            self.policy.written(tid, ok=False)
            return
        t.fd = result
        self.backend.submit([self._write_request(tid, t)])

    def _on_wrote(self, tid: int, t: TransferState, result: int) -> None:
        if result <= 0:
            failure = os_failure(Step.WRITE, result) if result else BlockFailure(Step.WRITE, detail="no progress")
            self._abandon_write(tid, t, failure)
            return
        t.done += result
        if t.done < t.expected:
            self.backend.submit([self._write_request(tid, t)])
        elif self.medium.sync_before_publish:
            self.backend.submit([IoRequest(OpKind.FSYNC, (Awaiting.FSYNC, tid), fd=t.fd)])
        else:
            self._publish(tid, t)

    def _on_synced(self, tid: int, t: TransferState, result: int) -> None:
        if result < 0:
            self._abandon_write(tid, t, os_failure(Step.FSYNC, result))
        else:
            self._publish(tid, t)

    def _publish(self, tid: int, t: TransferState) -> None:
        self._close(t)
        assert t.temp is not None
        try:
            if self.medium.publish(t.temp, t.block.path):
                t.job.result.published += 1
            t.job.result.bytes += t.expected
        except OSError as exc:
            self._fail(t, os_failure(Step.PUBLISH, exc))
            self.policy.written(tid, ok=False)
            return
        self.policy.written(tid, ok=True)

    def _abandon_write(self, tid: int, t: TransferState, failure: BlockFailure) -> None:
        self._close(t)
        if t.temp is not None:
            self.medium.abandon(t.temp)
        self._fail(t, failure)
        self.policy.written(tid, ok=False)
