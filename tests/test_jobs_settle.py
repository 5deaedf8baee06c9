"""``jobs/settle.py``: waiting for an engine's pykv processes to be quiet, from their counter files."""

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


def test_a_counter_file_is_written_off_the_callers_thread_latest_snapshot_last(tmp_path, monkeypatch):
    import threading

    from pykv import counters
    gate, writers, written = threading.Event(), set(), []

    def slow_write(path, content, durable=True):
        writers.add(threading.current_thread().name)
        gate.wait(10)
        written.append(content)
        (tmp_path / "out.json").write_text(content)
    monkeypatch.setattr(counters, "write_atomically", slow_write)
    f = CounterFile("worker0", base=str(tmp_path / "engine.stats"))
    for n in range(1, 6):  # the first write holds the writer; the next four wait, coalesced
        f.write({WorkerCounter.STORE_PUBLISHED: n})
    assert not f.flush(timeout=0.05)  # still writing
    f.write({WorkerCounter.STORE_PUBLISHED: 5})  # unchanged: no new write
    gate.set()
    assert f.flush()
    assert writers and threading.current_thread().name not in writers
    assert written[-1] == '{"store_published": 5}' and len(written) <= 2


def test_a_counter_file_that_cannot_be_written_warns_once_and_serving_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    f = CounterFile("worker0", base=str(blocker / "sub" / "engine.stats"))  # a parent that is a file
    for n in range(3):
        f.write({WorkerCounter.STORE_PUBLISHED: n})
        assert f.flush()
    assert [r.levelname for r in caplog.records if "counter file" in r.getMessage()] == ["WARNING"]


def test_a_counter_file_changed_at_interpreter_shutdown_is_written_at_once(tmp_path, monkeypatch):
    import json
    import threading

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    f = CounterFile("worker0", base=str(tmp_path / "engine.stats"))
    f.write({WorkerCounter.STORE_PUBLISHED: 4})
    assert json.loads((tmp_path / "engine.stats.worker0.json").read_text()) == {"store_published": 4}
    assert f.flush(timeout=0.1)
