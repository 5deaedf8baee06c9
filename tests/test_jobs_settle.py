"""``pykv/jobs/settle.py``: waiting for an engine's pykv processes to be quiet, from their counter files."""

from __future__ import annotations

from pykv.counters import CounterFile, CounterSnapshot, SchedulerCounter, WorkerCounter
from pykv.jobs.settle import busy, wait_until_quiet


def test_quiet_counters_settle_and_are_returned(tmp_path):
    base = str(tmp_path / "engine.stats")
    CounterFile("worker0", base=base).write({WorkerCounter.STORE_PUBLISHED: 3, WorkerCounter.JOBS_IN_FLIGHT: 0})
    CounterFile("scheduler", base=base).write({SchedulerCounter.PENDING_STORES: 0})
    quiet, snapshot = wait_until_quiet(base, timeout=30, interval=0.01)
    assert quiet and snapshot.worker(0)[WorkerCounter.STORE_PUBLISHED] == 3


def test_no_counters_or_busy_ones_never_settle(tmp_path):
    base = str(tmp_path / "engine.stats")
    assert wait_until_quiet(base, timeout=0.05, interval=0.01) == (False, CounterSnapshot())
    scheduler = CounterFile("scheduler", base=base)
    scheduler.write({SchedulerCounter.PENDING_STORES: 2})
    assert scheduler.flush()
    quiet, snapshot = wait_until_quiet(base, timeout=0.05, interval=0.01)
    assert not quiet and snapshot.scheduler() == {"pending_stores": 2}
    assert wait_until_quiet(base, timeout=30, interval=0.01, pending_stores=False)[0]  # the driver's wait


def test_busy_is_a_worker_job_in_flight_or_a_pending_store():
    assert busy(CounterSnapshot({"worker1": {WorkerCounter.JOBS_IN_FLIGHT: 1}}))
    assert busy(CounterSnapshot({"scheduler": {SchedulerCounter.PENDING_STORES: 1}}))
    assert not busy(CounterSnapshot({"scheduler": {SchedulerCounter.PENDING_STORES: 1}}), pending_stores=False)
    assert not busy(CounterSnapshot({"worker0": {WorkerCounter.JOBS_IN_FLIGHT: 0}}))

