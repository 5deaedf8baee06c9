"""The medium's blocking calls, off the reactor thread: each device (lane) has its own threads.

Every byte the reactor moves goes through its I/O backend, but a few steps around that I/O are
plain system calls of the medium: ``check_opened`` (fstat, fcntl) after each open,
``prepare_write`` (mkdir), ``publish`` (link), ``abandon`` (unlink), and the store's quarantine
(rename). Healthy, each takes microseconds; on a stalled mount (NFS, a stopped FUSE daemon) one
blocks for minutes and cannot be interrupted. On the reactor thread it would hold the work of
every device, so ``FileCalls`` runs each on the threads of the block's lane (daemon threads,
started on first use) and hands its ``Outcome`` back: ``run`` to the reactor thread (one command
posted for each burst of answers, so the hop costs one wake-up, not one per call), ``start``
on the lane's thread. A stalled device holds its own lane only; the job-level ``io_deadline``
(``pykv.stall``) gives up what waits on it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from pykv.daemon_threads import start_daemon_threads

log = logging.getLogger(__package__)

Result = TypeVar("Result")

THREAD_PREFIX = "pykv-files"
THREADS_PER_LANE = 2
"""Threads per device: a slow metadata call (a link over NFS) does not queue the next one behind it."""


@dataclass(slots=True)
class Outcome(Generic[Result]):
    """What one call returned, or the exception it raised."""

    result: Result | None = None
    error: Exception | None = None

    def get(self) -> Result:
        """The result; raises the call's exception (so a caller handles it as if it made the call)."""
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]


@dataclass(slots=True)
class _Call:
    call: Callable[[], object]
    done: Callable[[Outcome], None]

    def make(self) -> None:
        try:
            outcome = Outcome(self.call())
        except Exception as exc:  # noqa: BLE001 - handed to ``done``, which decides
            outcome = Outcome(error=exc)
        try:
            self.done(outcome)
        except Exception:  # noqa: BLE001 - a lane thread must outlive its callers' mistakes
            log.exception("file call %s: its continuation failed", getattr(self.call, "__name__", self.call))


class _Lane:
    """One device's queue and threads (started on first use); ``None`` in the queue stops a thread."""

    def __init__(self, index: int, threads: int) -> None:
        self.index, self.threads = index, threads
        self.queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.lock = threading.Lock()  # orders ``put`` against ``close``: no call is queued behind a stop
        self.workers: list[threading.Thread] = []
        self.closing = False

    def put(self, call: _Call) -> bool:
        """Queue ``call``; False when the lane is closed or no thread of it could be started."""
        with self.lock:
            if self.closing or (not self.workers and not self._start_threads()):
                return False
            self.queue.put(call)
            return True

    def close(self) -> None:
        with self.lock:
            if not self.closing:
                self.closing = True
                for _ in self.workers:
                    self.queue.put(None)

    def _start_threads(self) -> bool:
        """The lane's threads, on its first call; False when none could be started."""
        self.workers = start_daemon_threads(self._work, self.threads, f"{THREAD_PREFIX}-{self.index}")
        return bool(self.workers)

    def _work(self) -> None:
        while (call := self.queue.get()) is not None:
            call.make()


class FileCalls:
    """Blocking calls on per-device threads; see the module docstring. ``post(command)`` runs
    ``command`` on the reactor thread (``Reactor._post``)."""

    def __init__(self, lanes: int, post: Callable[[Callable[[], None]], None], *,
                 threads_per_lane: int = THREADS_PER_LANE) -> None:
        if lanes < 1 or threads_per_lane < 1:
            raise ValueError(f"need at least one lane and one thread, got {lanes} and {threads_per_lane}")
        self._lanes = [_Lane(i, threads_per_lane) for i in range(lanes)]
        self._post = post
        self._answers: list[Callable[[], None]] = []  # continuations waiting for the reactor thread
        self._answers_lock = threading.Lock()
        self.pending = 0  # (reactor thread) calls of ``run`` whose continuation has not run yet

    def run(self, lane: int, call: Callable[[], Result], then: Callable[[Outcome[Result]], None]) -> None:
        """(Reactor thread.) ``call()`` on ``lane``'s threads, then ``then(outcome)`` on the reactor
        thread; counted in ``pending`` until then."""
        self.pending += 1
        self.start(lane, call, lambda outcome: self._answer(lambda: self._settle(then, outcome)))

    def start(self, lane: int, call: Callable[[], Result], done: Callable[[Outcome[Result]], None]) -> None:
        """(Any thread.) ``call()`` on ``lane``'s threads, then ``done(outcome)`` on that thread. After
        ``close`` (or with no thread to be had) both run on the caller's thread, as they would have
        without this class."""
        pending = _Call(call, done)
        if not self._lanes[lane].put(pending):
            pending.make()

    def _answer(self, command: Callable[[], None]) -> None:
        """(A lane thread.) Queue a continuation; the first of a burst posts the one drain."""
        with self._answers_lock:
            self._answers.append(command)
            first = len(self._answers) == 1
        if first:
            self._post(self._drain)

    def _drain(self) -> None:
        with self._answers_lock:
            answers, self._answers = self._answers, []
        for command in answers:
            command()

    def _settle(self, then: Callable[[Outcome[Result]], None], outcome: Outcome[Result]) -> None:
        self.pending -= 1
        then(outcome)

    def threads_alive(self) -> int:
        """Threads of the lanes still running (after ``close``: those a stalled call holds)."""
        return sum(thread.is_alive() for lane in self._lanes for thread in lane.workers)

    def close(self, timeout: float | None = None) -> bool:
        """Take no more calls (later ones run on their caller's thread), let the threads finish the
        queued ones within ``timeout``; False when a call still runs (left to its daemon thread)."""
        for lane in self._lanes:
            lane.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in self._lanes:
            for thread in lane.workers:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.threads_alive()
