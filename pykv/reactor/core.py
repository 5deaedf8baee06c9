"""The reactor: one thread that owns the I/O backend and carries out the policy's actions.

Clients (the connector worker, ``pykv bench``, ``pykv warm``) submit jobs of
storage blocks from any thread. The reactor opens files ahead, reads each block
into a staging slot, checks its header (and payload checksum when asked, on the
verifier threads of ``pykv.reactor.verify`` so hashing never stalls the I/O; with a key ring
the block's MAC instead, and a block the ring refuses is a failed load) and
hands every block that became ready in one iteration to the ``LoadSink`` as one
batch; each of the medium's ``lanes`` (devices) gets its own in-flight depth.
Stores run the other way: the ``StoreSource`` fills a slot, the verifier threads seal
it (checksum, and with a key ring the MAC), the reactor writes header and payload
to a temporary file and publishes it. ``shed_stores`` drops the blocks of stores that still
wait for a slot when the client cannot wait for them (vLLM reusing their GPU blocks).
The decisions live in ``ReactorPolicy``; where a block lives and how it is opened,
checked, published and quarantined is the ``Medium``'s (``pykv.media``); the reactor
schedules (this module) and hands the steps to its collaborators: ``Loads``
(``pykv.reactor.loads``) and ``Stores`` (``pykv.reactor.stores``), over the
``ReactorContext`` they share (``pykv.reactor.context``: resources and transfers). The
medium's blocking calls (an open's fstat, a store's mkdir, link, unlink) run on the threads
of the block's device (``pykv.reactor.fileops``), never on the reactor thread: a stalled
device holds its own blocks only.

Preloads: ``read_ahead(owner, blocks)`` reads blocks ahead for a request
that still waits (``owner``); one preload per file however many owners want it.
A later ``read(..., owner=...)`` of the same file claims the preload
(shares its slot or joins its read) instead of reading it again;
``release_preloads(owner)`` drops the owner's interest, and a preload nobody
wants any more frees its slot. ``stats`` counts reads, claims and waste.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections import Counter
from typing import Callable, Collection, Hashable, Sequence

from pykv.auth import KeyRing
from pykv.failures import BlockFailure, Step
from pykv.io.backend import IoBackend, IoCompletion, IoRequest
from pykv.media.base import Medium
from pykv.policy import Deliver, Fill, Finish, Kind, Open, Read, ReactorPolicy, Write
from pykv.reactor.context import ReactorContext
from pykv.reactor.fileops import FileCalls, Outcome
from pykv.reactor.loads import Loads
from pykv.reactor.stores import Stores
from pykv.reactor.types import (STATS, Awaiting, JobResult, JobState, LoadBlock, LoadSink, ReactorConfig, StoreBlock,
                                StoreSource, TransferState)
from pykv.reactor.verify import PayloadVerifier
from pykv.staging import StagingPool

log = logging.getLogger(__package__)  # "pykv.reactor": one logger for the whole reactor

SHED = BlockFailure(Step.SHED, detail="vLLM needed the GPU blocks back before a staging slot was free")


class Reactor:
    """Runs the I/O pipeline on its own thread; all public methods are thread-safe."""

    def __init__(self, backend: IoBackend, pool: StagingPool, medium: Medium, *, config: ReactorConfig | None = None,
                 sink: LoadSink | None = None, source: StoreSource | None = None,
                 on_job_done: Callable[[JobResult], None] | None = None, keys: KeyRing | None = None) -> None:
        self.config = config or ReactorConfig()
        if self.config.verify not in ("full", "header"):
            raise ValueError(f"verify must be 'full' or 'header', got {self.config.verify!r}")
        segment = self.config.read_segment
        if segment < 0 or segment % 4096:
            raise ValueError(f"read_segment must be a multiple of 4096 bytes (or 0), got {segment}")
        pieces, lanes = self.config.requests_per_read(pool.slot_bytes), medium.lanes
        if (pieces > 1 or lanes > 1) and backend.depth < lanes * (self.config.io_depth * pieces
                                                                  + self.config.open_ahead):
            raise ValueError(f"backend depth {backend.depth} is too small for {self.config.io_depth} reads of "
                             f"{pieces} pieces on each of {lanes} lanes; use backend_depth()")
        self.backend, self.pool, self.medium = backend, pool, medium
        self.sink, self.source, self.on_job_done = sink, source, on_job_done
        self.policy = ReactorPolicy(pool.ledger, self.config.io_depth, self.config.open_ahead,
                                    max_speculative=self.config.max_speculative, lanes=lanes)
        self.keys = keys  # with a key ring every load is authenticated and every store signed
        self._verifier = PayloadVerifier(self.config.verify_threads, keys)  # threads start on first use
        self.stats: Counter[str] = Counter({name: 0 for name in STATS})  # written by the reactor thread only
        self._files = FileCalls(lanes, self._post)  # threads start on first use
        self._ctx = ReactorContext(backend, pool, medium, self.policy, self._verifier, self._post, self._files,
                                   self.stats)
        self._loads = Loads(self._ctx, sink, read_segment=self.config.read_segment,
                            verify=self.config.verify == "full" or keys is not None)
        self._stores = Stores(self._ctx, source)
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._finished: list[JobResult] = []
        self._done = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pykv-reactor", daemon=True)
        self._thread.start()

    # -- client API (any thread) -----------------------------------------------------------
    def read(self, job: object, blocks: Sequence[LoadBlock], *, owner: Hashable | None = None,
                    urgent: bool = False) -> None:
        """Load ``blocks``; a block being preloaded is served by its preload (one read).
        ``owner``: the request the job belongs to; its interest in those preloads ends.
        ``urgent``: the caller waits for it now: its blocks go ahead of all other work."""
        self._post(lambda: self._add_job(job, Kind.LOAD, blocks, owner=owner, urgent=urgent))

    def read_ahead(self, owner: Hashable, blocks: Sequence[LoadBlock]) -> None:
        """Read ``blocks`` ahead into staging slots for ``owner`` (a request still waiting).

        Speculative work: it runs after all demand work, one read at a time, within the
        policy's slot bounds, and is never reported as a job. A block already preloaded
        gains ``owner`` as one more interested party (one read, one slot). Raises ``ValueError``
        (here, before anything starts) for a block with a caller's slot.
        """
        for block in blocks:
            if block.slot is not None:
                raise ValueError(f"{block.path}: a preload reads into a staging slot, not a caller's slot")
        self._post(lambda: self._loads.add_preloads(owner, blocks))

    def release_preloads(self, owner: Hashable) -> None:
        """``owner`` no longer needs its preloads (scheduled, finished or aborted)."""
        self._post(lambda: self._loads.release_preloads(owner))

    def write(self, job: object, blocks: Sequence[StoreBlock]) -> None:
        self._post(lambda: self._add_job(job, Kind.STORE, blocks))

    def shed_stores(self, jobs: Collection[object], done: Callable[[list[tuple[object, int]]], None]) -> None:
        """Drop the blocks of these store jobs that still wait for a slot once the slots free now
        are granted (they fail with ``Step.SHED``); ``done([(job, index), ...])`` on the reactor
        thread names them. Blocks being filled or written go on."""
        self._post(lambda: done(self._shed(set(jobs))))

    def consumed(self, transfer: int) -> None:
        """The consumer is done with a delivered slot."""
        self._post(lambda: self.policy.consumed(transfer))

    def filled(self, transfer: int, ok: bool = True, stored: int | None = None) -> None:
        """The source finished (or failed) filling a store's slot; ``stored``: it left that many bytes
        encoded with the block's ``codec`` at the start of the payload (None: the raw payload)."""
        self._post(lambda: self._stores.on_filled(transfer, ok, stored))

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

    def call_on_lane(self, lane: int, call: Callable[[], object], done: Callable[[Outcome], None]) -> None:
        """Make the medium's blocking call ``call()`` (a quarantine's rename) on the threads of device
        ``lane``, then ``done(outcome)`` on that thread; after ``close`` both run on the caller's."""
        self._files.start(lane, call, done)

    def close(self, timeout: float | None = None) -> bool:
        """Finish in-flight work (I/O, checks, the medium's calls), stop the threads and close the
        backend. With ``timeout``: False when the I/O or a medium call in flight did not end within it
        (a stalled mount): the reactor thread and the backend are left as they are (the caller must
        keep the memory they use)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._post(self._stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if not self._files.close(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
        self._verifier.close()
        self.backend.close()
        return True

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
            actions = self.policy.step()
            while actions:  # what performing changed (a write refused at once, a freed depth) is granted too
                self._perform(actions)
                actions = self.policy.step()
            self._note_high_water()
            if (self._stopping and self.backend.in_flight == 0 and not self._ctx.hashing and not self._files.pending
                    and not self._inbox):
                return
            if self._inbox:
                continue
            for completion in self.backend.wait(min_completions=1, timeout=None if not self._stopping else 0.05):
                self._complete(completion)

    def _add_job(self, job: object, kind: Kind, blocks: Sequence[LoadBlock | StoreBlock],
                 owner: Hashable | None = None, urgent: bool = False) -> None:
        state = JobState(JobResult(job, kind, len(blocks)), len(blocks), time.monotonic())
        if not blocks:
            self._finish_job(state)
        for index, block in enumerate(blocks):
            lane = self.medium.lane(block.path)
            tid = self._ctx.add_transfer(TransferState(state, index, block, lane=lane))
            if kind is Kind.LOAD and self._loads.claim(tid, block, owner):
                continue
            self.policy.add(tid, kind, slot=block.slot, urgent=urgent, lane=lane)

    def _shed(self, jobs: set[object]) -> list[tuple[object, int]]:
        self._perform(self.policy.step())  # a store that can have a slot now keeps its blocks
        shed = []
        for tid in self.policy.queued_stores():
            t = self._ctx.transfers[tid]
            if t.job.result.job in jobs and self.policy.shed(tid):
                self._ctx.fail(t, SHED)
                shed.append((t.job.result.job, t.index))
        return shed

    def _note_high_water(self) -> None:
        ledger = self.pool.ledger
        held = ledger.num_slots - ledger.reserved - ledger.free
        if held > self.stats["slots_high"]:
            self.stats["slots_high"] = held
        if self._loads.preloading:
            speculative = self.policy.speculative_slots
            if speculative > self.stats["preload_slots_high"]:
                self.stats["preload_slots_high"] = speculative

    def _perform(self, actions: list) -> None:
        """Carry out one policy step: disk requests go to the backend before deliveries are handed
        to the sink (whose copies can take a while to issue), so the devices are never kept waiting."""
        requests: list[IoRequest] = []
        deliveries: list[Deliver] = []
        for action in actions:
            if isinstance(action, Open):
                requests.append(self._loads.open_request(action.transfer))
            elif isinstance(action, Read):
                requests.extend(self._loads.start_read(action.transfer, action.slot))
            elif isinstance(action, Fill):
                self._stores.request_fill(action)
            elif isinstance(action, Write):
                self._stores.start_write(action.transfer)
            elif isinstance(action, Deliver):
                deliveries.append(action)
            elif isinstance(action, Finish):
                self._on_finish(action)
        if requests:
            self.backend.submit(requests)
        for action in deliveries:
            self._loads.deliver(action)

    def _complete(self, completion: IoCompletion) -> None:
        awaiting, tid, *part = completion.token
        result = completion.result
        if awaiting is Awaiting.CLOSE:
            if result < 0:
                log.warning("close failed: %s", os.strerror(-result))
            return
        t = self._ctx.transfers[tid]
        if awaiting is Awaiting.SEGMENT:
            self._loads.on_segment(tid, t, part[0], result)
            return
        handler = {Awaiting.OPEN: self._loads.on_opened, Awaiting.READ: self._loads.on_read,
                   Awaiting.WRITE_OPEN: self._stores.on_write_opened, Awaiting.WRITE: self._stores.on_wrote,
                   Awaiting.FSYNC: self._stores.on_synced}[awaiting]
        handler(tid, t, result)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _on_finish(self, action: Finish) -> None:
        t = self._ctx.transfers.pop(action.transfer)
        if t.fd >= 0:
            self._ctx.close(t)
        if t.owners is not None:
            self._loads.preload_ended(action.transfer, t, action.ok)
        t.job.remaining -= 1
        if t.job.remaining == 0:
            self._finish_job(t.job)

    def _finish_job(self, job: JobState) -> None:
        if job.internal:
            return
        job.result.seconds = time.monotonic() - job.started
        if self.on_job_done is not None:
            self.on_job_done(job.result)  # the callback owns the result: nothing to keep
            return
        with self._done:
            self._finished.append(job.result)
            self._done.notify_all()
