"""Blocking file-system calls per device, each batch answered within a deadline.

The scheduler's existence checks (one ``lstat`` per block, rank and candidate device) and a
disk hit's access stamps are blocking calls. Healthy, one takes microseconds (warm caches) to
a few milliseconds (cold metadata); on a stalled shared mount (NFS, Lustre, a FUSE daemon
that stopped) one can hang for minutes. So none runs on the caller's thread: each device
(*lane*) has its own few threads, a batch waits at most ``deadline`` and an unanswered call is
``None`` (the caller counts it a miss). A lane with a call running longer than half the deadline
is *stalled*: its calls answer ``None`` at once, without queueing, until that call returns; a lane
queues at most ``MAX_PENDING`` calls. The threads are daemons: a process whose mount hangs can
still exit. One lane's stall never delays another lane's answers.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from pykv.daemon_threads import start_daemon_threads

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")

THREAD_PREFIX = "pykv-lookup"
MAX_PENDING = 4096
"""Calls a lane queues at most (beyond them a call answers ``None`` at once)."""
THREADS_PER_LANE = 2
STALLED = 0.5
"""A lane whose oldest running call has run this fraction of the deadline is stalled (so after one
batch timed out on it, the next answers at once)."""


class _Batch(Generic[Result]):
    """Answers of one ``LaneCalls.run``: filled by the lanes' threads, read once by the caller."""

    def __init__(self, count: int) -> None:
        self.results: list[Result | None] = [None] * count
        self.left = count
        self.expired = False  # the caller stopped waiting: queued calls of the batch are skipped
        self._cond = threading.Condition()

    def answer(self, index: int, result: Result | None) -> None:
        with self._cond:
            if not self.expired:
                self.results[index] = result
            self.left -= 1
            if self.left == 0:
                self._cond.notify_all()

    def wait(self, until: float, clock: Callable[[], float]) -> tuple[list[Result | None], int]:
        """The answers by ``until`` (unanswered: None), and how many calls did not answer."""
        with self._cond:
            while self.left:
                remaining = until - clock()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            self.expired = True
            return list(self.results), self.left


@dataclass(slots=True)
class _Call:
    call: Callable
    item: object
    batch: _Batch | None
    index: int


class _Lane:
    """One device's queue and threads (started on first use)."""

    def __init__(self, index: int, threads: int, clock: Callable[[], float]) -> None:
        self.index, self.threads, self._clock = index, threads, clock
        self.queue: collections.deque[_Call] = collections.deque()
        self.running: dict[int, float] = {}  # thread ident -> when its call began
        self.cond = threading.Condition()
        self.workers: list[threading.Thread] = []
        self.closing = False

    def stalled_for(self, now: float) -> float:
        """How long the oldest running call has run (0: none running). Caller holds ``cond``."""
        return max((now - began for began in self.running.values()), default=0.0)

    def put(self, call: _Call, deadline: float) -> bool:
        """Queue ``call``; False when the lane is stalled, closing or full (the call is not made)."""
        with self.cond:
            if self.closing or len(self.queue) >= MAX_PENDING or self.stalled_for(self._clock()) > deadline * STALLED:
                return False
            if not self.workers and not self._start_threads():
                return False
            self.queue.append(call)
            self.cond.notify()
            return True

    def _start_threads(self) -> bool:
        """The lane's threads, on its first call; False when none could be started."""
        self.workers = start_daemon_threads(self._work, self.threads, f"{THREAD_PREFIX}-{self.index}")
        return bool(self.workers)

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait()
                if not self.queue:
                    return
                call = self.queue.popleft()
                if call.batch is not None and call.batch.expired:
                    call.batch.answer(call.index, None)
                    continue
                self.running[me] = self._clock()
            result = None
            try:
                result = call.call(call.item)
            except Exception:  # noqa: BLE001 - an unanswerable call is a miss; logged, never raised here
                log.debug("pykv: lookup call %s failed", getattr(call.call, "__name__", call.call), exc_info=True)
            finally:
                with self.cond:
                    del self.running[me]
            if call.batch is not None:
                call.batch.answer(call.index, result)


class LaneCalls:
    """Blocking calls on per-device threads; see the module docstring."""

    def __init__(self, lanes: int, deadline: float, *, threads_per_lane: int = THREADS_PER_LANE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lanes < 1 or threads_per_lane < 1:
            raise ValueError(f"need at least one lane and one thread, got {lanes} and {threads_per_lane}")
        if not deadline > 0:
            raise ValueError(f"deadline must be positive, got {deadline}")
        self.deadline, self._clock = deadline, clock
        self._lanes = [_Lane(i, threads_per_lane, clock) for i in range(lanes)]
        self.unanswered = 0  # calls answered None for want of time (the lane stalled, slow or full)

    def run(self, call: Callable[[Item], Result], items: Sequence[tuple[int, Item]]) -> list[Result | None]:
        """``call(item)`` for each ``(lane, item)``, in order; ``None`` where no answer came within the
        deadline or the lane is stalled. An exception of ``call`` is ``None`` too."""
        if not items:
            return []
        until = self._clock() + self.deadline
        batch: _Batch[Result] = _Batch(len(items))
        refused = 0
        for index, (lane, item) in enumerate(items):
            if not self._lanes[lane].put(_Call(call, item, batch, index), self.deadline):
                batch.answer(index, None)
                refused += 1
        results, missing = batch.wait(until, self._clock)
        self.unanswered += missing + refused
        return results

    def start(self, call: Callable[[Item], object], items: Sequence[tuple[int, Item]]) -> int:
        """``call(item)`` for each ``(lane, item)`` without waiting (results and errors dropped); a
        stalled or full lane skips its calls. Returns how many were queued."""
        return sum(self._lanes[lane].put(_Call(call, item, None, 0), self.deadline) for lane, item in items)

    def stalled(self) -> list[int]:
        """The stalled lanes (a call running longer than half the deadline)."""
        now = self._clock()
        stalled = []
        for lane in self._lanes:
            with lane.cond:
                if lane.stalled_for(now) > self.deadline * STALLED:
                    stalled.append(lane.index)
        return stalled

    def threads_alive(self) -> int:
        """Threads of the lanes still running (after ``close``: those a stalled call holds)."""
        return sum(thread.is_alive() for lane in self._lanes for thread in lane.workers)

    def close(self, timeout: float = 1.0) -> bool:
        """Take no more calls, let the threads finish the queued ones within ``timeout``, then drop what
        is left; False when a call is still running (a stalled one is left to its daemon thread)."""
        for lane in self._lanes:
            with lane.cond:
                lane.closing = True
                lane.cond.notify_all()
        until = time.monotonic() + timeout
        for lane in self._lanes:
            for thread in lane.workers:
                thread.join(max(0.0, until - time.monotonic()))
        for lane in self._lanes:
            with lane.cond:
                lane.queue.clear()
        return not self.threads_alive()
