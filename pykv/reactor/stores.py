"""The reactor's store steps: the source fills a slot, the verifier threads seal it (header with
the payload's checksum in front of the payload; with a key ring, signed), the reactor writes it to the medium's
temporary file and has the medium publish it. The medium's blocking calls (``prepare_write``, ``publish``,
``abandon``) run on the block's device threads (``ReactorContext.files``); the block's step goes on when
each comes back.

``Stores`` runs on the reactor thread only; the ``Reactor`` (``pykv.reactor.core``) calls it for
the policy's ``Fill`` and ``Write`` actions, ``Reactor.filled`` and the completions of its requests.
"""

from __future__ import annotations

import logging

from pykv.failures import BlockFailure, Step, os_failure
from pykv.format import HEADER_SIZE, BlockHeader
from pykv.format_codec import NONE
from pykv.io.backend import IoRequest, OpKind
from pykv.policy import Fill
from pykv.media.base import WriteTarget
from pykv.reactor.context import ReactorContext
from pykv.reactor.fileops import Outcome
from pykv.reactor.types import Awaiting, FillRequest, StoreBlock, StoreSource, TransferState

log = logging.getLogger(__package__)


class Stores:
    """Stores; see ``pykv.reactor.core`` for the whole picture.

    Uses the context's backend, pool, medium, policy, verifier, files, transfers, ``hashing``, ``post``,
    ``close`` and ``fail``; ``source`` fills the slots (None: every fill fails), and its optional
    ``staged(job, index)`` hook hears of each block whole in its slot."""

    def __init__(self, context: ReactorContext, source: StoreSource | None) -> None:
        self._ctx = context
        self._backend, self._pool, self._medium, self._policy = (context.backend, context.pool, context.medium,
                                                                 context.policy)
        self._verifier, self._transfers = context.verifier, context.transfers
        self._source = source
        self._staged = getattr(source, "staged", None)  # StoreSource's optional hook

    def request_fill(self, action: Fill) -> None:
        t = self._transfers[action.transfer]
        t.slot = action.slot
        request = FillRequest(action.transfer, t.job.result.job, t.index, action.slot,
                              t.block.geometry.payload_length, t.block.target)
        if self._source is None:
            self.on_filled(action.transfer, False)
        else:
            self._source.fill([request])

    def on_filled(self, tid: int, ok: bool, stored: int | None = None) -> None:
        t = self._transfers[tid]
        raw = t.block.geometry.payload_length
        if ok and stored is not None and (t.block.codec == NONE or not 0 < stored < raw):
            ok = False  # a source's bug: never write what no header can describe
            log.error("%s: the source stored %s bytes of codec %s for a %d-byte payload", t.block.path, stored,
                      t.block.codec, raw)
        if not ok:
            self._ctx.fail(t, BlockFailure(Step.FILL, detail="the source could not fill the slot"))
            self._sealed(tid, t, None)
            return
        head = self._pool.view(t.slot)[:HEADER_SIZE]
        payload = self._pool.payload_view(t.slot, raw if stored is None else stored)
        codec = NONE if stored is None else t.block.codec
        self._ctx.hashing += 1  # checksum (and MAC): on the verifier threads, beside the I/O of other blocks
        self._verifier.seal(t.block, head, payload, lambda header: self._ctx.post(lambda: self._on_signed(tid, header)),
                            codec=codec)

    def _on_signed(self, tid: int, header: BlockHeader | None) -> None:
        self._ctx.hashing -= 1
        t = self._transfers[tid]
        if header is None:
            self._ctx.fail(t, BlockFailure(Step.FILL, detail="signing the block failed"))
        self._sealed(tid, t, header)

    def _sealed(self, tid: int, t: TransferState, header: BlockHeader | None) -> None:
        """The slot of a filled store holds the whole block, header in front (``header`` None: failed)."""
        if header is not None:
            t.header, t.expected = header, header.file_size
        self._policy.filled(tid, header is not None)
        if header is not None and self._staged is not None:
            self._staged(t.job.result.job, t.index)

    def start_write(self, tid: int) -> None:
        """The policy granted the write: the medium prepares it (directories, temporary name), then
        the temporary file is opened (``_prepared``)."""
        t = self._transfers[tid]
        block = t.block
        assert isinstance(block, StoreBlock) and t.header is not None  # sealed in on_filled
        self._zero_padding(t)
        self._ctx.files.run(t.lane, lambda: self._medium.prepare_write(block.path),
                            lambda outcome: self._prepared(tid, t, outcome))

    def _prepared(self, tid: int, t: TransferState, outcome: Outcome[WriteTarget]) -> None:
        try:
            target = outcome.get()
        except OSError as exc:  # the medium refused the store
            self._ctx.fail(t, os_failure(Step.MKDIR, exc))
            self._policy.written(tid, ok=False)
            return
        t.temp, spec = target.temp, target.open
        self._backend.submit([IoRequest(OpKind.OPEN, (Awaiting.WRITE_OPEN, tid), path=spec.path, flags=spec.flags,
                                        mode=spec.mode, resolve=spec.resolve)])

    def _zero_padding(self, t: TransferState) -> None:
        start = HEADER_SIZE + t.header.payload_length
        view = self._pool.view(t.slot)
        view[start:t.expected] = bytes(t.expected - start)

    def _write_request(self, tid: int, t: TransferState) -> IoRequest:
        return IoRequest(OpKind.WRITE, (Awaiting.WRITE, tid), fd=t.fd, address=self._pool.address(t.slot) + t.done,
                         length=t.expected - t.done, offset=t.done)

    def on_write_opened(self, tid: int, t: TransferState, result: int) -> None:
        if result < 0:
            t.temp = None  # an exclusive create: nothing of ours was created
            self._ctx.fail(t, os_failure(Step.OPEN_FOR_WRITE, result))
            self._policy.written(tid, ok=False)
            return
        t.fd = result
        self._backend.submit([self._write_request(tid, t)])

    def on_wrote(self, tid: int, t: TransferState, result: int) -> None:
        if result <= 0:
            failure = os_failure(Step.WRITE, result) if result else BlockFailure(Step.WRITE, detail="no progress")
            self._abandon_write(tid, t, failure)
            return
        t.done += result
        if t.done < t.expected:
            self._backend.submit([self._write_request(tid, t)])
        elif self._medium.sync_before_publish:
            self._backend.submit([IoRequest(OpKind.FSYNC, (Awaiting.FSYNC, tid), fd=t.fd)])
        else:
            self._publish(tid, t)

    def on_synced(self, tid: int, t: TransferState, result: int) -> None:
        if result < 0:
            self._abandon_write(tid, t, os_failure(Step.FSYNC, result))
        else:
            self._publish(tid, t)

    def _publish(self, tid: int, t: TransferState) -> None:
        self._ctx.close(t)
        temp = t.temp
        assert temp is not None
        self._ctx.files.run(t.lane, lambda: self._medium.publish(temp, t.block.path),
                            lambda outcome: self._published(tid, t, outcome))

    def _published(self, tid: int, t: TransferState, outcome: Outcome[bool]) -> None:
        try:
            if outcome.get():
                t.job.result.published += 1
            t.job.result.bytes += t.expected
        except OSError as exc:
            self._ctx.fail(t, os_failure(Step.PUBLISH, exc))
            self._policy.written(tid, ok=False)
            return
        self._policy.written(tid, ok=True)

    def _abandon_write(self, tid: int, t: TransferState, failure: BlockFailure) -> None:
        """The write failed: its temporary file (if created) is removed before the block ends."""
        self._ctx.close(t)
        self._ctx.fail(t, failure)
        temp = t.temp
        if temp is None:
            self._policy.written(tid, ok=False)
            return
        self._ctx.files.run(t.lane, lambda: self._medium.abandon(temp),
                            lambda outcome: self._policy.written(tid, ok=False))
