"""Wait until an engine's pykv processes are quiet, read from their counter files (``pykv.counters``)."""

from __future__ import annotations

import time
from pathlib import Path

from pykv.counters import CounterSnapshot, SchedulerCounter, read_counters


def busy(snapshot: CounterSnapshot, *, pending_stores: bool = True) -> bool:
    """Whether a worker has jobs vLLM was not told about yet, or (``pending_stores``) the
    scheduler still waits for stores."""
    return snapshot.busy or (pending_stores and bool(snapshot.scheduler().get(SchedulerCounter.PENDING_STORES, 0)))


def wait_until_quiet(base: str | Path, timeout: float, *, interval: float = 0.3,
                     pending_stores: bool = True) -> tuple[bool, CounterSnapshot]:
    """Poll the counter files under ``base`` until they exist, are not ``busy`` and did not change
    since the previous poll; (True, them), or (False, the last read) after ``timeout`` seconds."""
    deadline, previous = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        snapshot = read_counters(base)
        if snapshot.roles and not busy(snapshot, pending_stores=pending_stores) and snapshot == previous:
            return True, snapshot
        previous = snapshot
        time.sleep(interval)
    return False, read_counters(base)
