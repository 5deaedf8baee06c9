"""Many small blocking file-system calls at once: the existence checks of a request's blocks.

A disk hit's lookups are one ``lstat`` per block (and per rank), made by the scheduler before
the load can start. With the directory and inode caches warm each takes microseconds; cold
(a tree larger than the kernel's caches, or a fresh host) each one waits for a metadata read
from its device, and one after another they add up to tens of milliseconds before an 80k
load begins. ``FanOut`` runs them on a few threads instead (``lstat`` releases the GIL), so the
devices serve the metadata reads in parallel. Short lists run inline: threads would cost more.
``start`` runs calls nobody waits for there too (a disk hit's atime stamps: an 80k hit's 320
``stat`` + ``utime`` pairs took 7-12 ms of the scheduler's step on a 2-core machine).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")

INLINE_MAX = 8
"""Up to this many items run on the calling thread."""
THREAD_PREFIX = "pykv-lookup"


def lookup_threads(devices: int) -> int:
    """Threads for the lookups over ``devices`` devices: two per device, 4 to 16."""
    return max(4, min(16, 2 * devices))


class FanOut:
    """``map`` a blocking call over items on ``threads`` threads (started on first use), in order."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._inline_noted = False

    def map(self, call: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
        """``[call(item) for item in items]``, run on the threads when there are more than
        ``INLINE_MAX`` items; an exception of ``call`` propagates, as inline. Where no thread can
        be started (the process's thread limit, an interpreter shutting down) the calls run inline."""
        if len(items) <= INLINE_MAX or self.threads == 1:
            return [call(item) for item in items]
        share = self.threads
        parts = [items[i::share] for i in range(share)]  # interleaved: each thread gets every device
        try:
            pool = self._executor()
            futures = [pool.submit(lambda part=part: [call(item) for item in part]) for part in parts]
        except RuntimeError as exc:  # "can't start new thread", "cannot schedule new futures after shutdown"
            if not self._inline_noted:
                log.warning("pykv: lookups run one after another: no lookup thread could be started (%s)", exc)
                self._inline_noted = True
            return [call(item) for item in items]
        done = [future.result() for future in futures]
        results: list = [None] * len(items)
        for i, part in enumerate(done):
            results[i::share] = part
        return results

    def start(self, call: Callable[[Item], object], items: Sequence[Item]) -> None:
        """``call`` over ``items`` on the threads without waiting for it (errors are logged, results
        dropped); inline for a short list or where no thread can be started, as ``map``."""
        if len(items) <= INLINE_MAX or self.threads == 1:
            _each(call, items)
            return
        parts = [items[i::self.threads] for i in range(self.threads)]
        for started, part in enumerate(parts):
            try:
                self._executor().submit(_each, call, part)
            except RuntimeError:  # no thread: what is not handed over runs here, as map does
                for rest in parts[started:]:
                    _each(call, rest)
                return

    def _executor(self) -> ThreadPoolExecutor:
        """The threads, started on first use (``RuntimeError`` where none can be started)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=THREAD_PREFIX)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _each(call: Callable[[Item], object], items: Sequence[Item]) -> None:
    """``call`` on each item; an error is logged and the rest go on (``FanOut.start``'s work)."""
    for item in items:
        try:
            call(item)
        except Exception:  # noqa: BLE001 - background work: logged, never raised into the pool
            log.warning("pykv: background call %s failed", getattr(call, "__name__", call), exc_info=True)
