"""``idle_wait_ms``: on an engine step that runs no model, the worker waits (GIL free) for a load to
end instead of letting vLLM's loop go round at once; never longer than the setting, never without
loads in flight, and a job that ends wakes it at once."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_connector_worker import keys, rig, run  # noqa: E402,F401 - rig is a fixture
from worker_helpers import hold_writes  # noqa: E402

from pykv.config import PykvConfig  # noqa: E402
from pykv.connector.compat import GPULoadStoreSpec, OffloadingConnector, OffloadingConnectorMetadata  # noqa: E402
from pykv.connector.compat import ReqContext  # noqa: E402
from pykv.connector.connector import PykvConnectorMetadata, PykvOffloadingConnector  # noqa: E402
from pykv.errors import InputError  # noqa: E402


def stored_then_held_load(manager, worker, salt: int):
    """Two blocks stored, then a load of them whose copies to the KV cache are held back: (held,
    release) - the load stays open until ``release()``."""
    ks = keys(2, salt=salt)
    worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), manager.prepare_store(ks, ReqContext("r")).store_spec)
    run(worker, 1)
    manager.complete_store(ks, ReqContext("r"))
    held, deliver = [], worker.copier.from_slots
    worker.copier.from_slots = lambda tasks, done: held.append((tasks, done))
    worker.submit_load(2, manager.prepare_load(ks, ReqContext("r")), GPULoadStoreSpec(list(range(8, 16)), [8], [0]))
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held, "the load never reached its copies"

    def release() -> None:
        worker.copier.from_slots = deliver
        for tasks, done in held:
            deliver(tasks, done)
    return held, release


def timed_wait(worker) -> float:
    began = time.perf_counter()
    worker.wait_idle_step()
    return time.perf_counter() - began


def test_an_idle_step_waits_at_most_idle_wait_ms_while_a_load_runs(rig):
    manager, worker, _ = rig(idle_wait_ms=40)
    _, release = stored_then_held_load(manager, worker, salt=40)
    waited = timed_wait(worker)
    assert 0.035 <= waited < 2.0
    assert (worker.counters["idle_waits"], worker.counters["idle_wait_us"] >= 35_000) == (1, True)
    release()
    failed, report = run(worker, 2)
    assert not failed and not report


def test_a_load_that_ends_wakes_the_wait_at_once(rig):
    manager, worker, _ = rig(idle_wait_ms=50)
    object.__setattr__(worker.pykv, "idle_wait_ms", 10_000.0)  # past the key's bound: only a wake can end it soon
    _, release = stored_then_held_load(manager, worker, salt=41)
    timer = threading.Timer(0.2, release)
    timer.start()
    waited = timed_wait(worker)
    timer.join()
    assert 0.15 <= waited < 5.0
    assert [r.job_id for r in worker.get_finished()] == [2]


def test_no_wait_without_a_load_in_flight(rig, monkeypatch):
    manager, worker, _ = rig(idle_wait_ms=50)
    assert timed_wait(worker) < 0.02  # nothing in flight
    hold_writes(monkeypatch)  # a store whose writes never end: a job in flight, but no load
    ks = keys(2, salt=42)
    worker.submit_store(7, GPULoadStoreSpec(list(range(8)), [8], [0]), manager.prepare_store(ks, ReqContext("s")).store_spec)
    assert timed_wait(worker) < 0.02
    assert worker.counters["idle_waits"] == 0


def test_no_wait_while_an_ended_load_is_not_yet_collected(rig):
    manager, worker, _ = rig(idle_wait_ms=50)
    _, release = stored_then_held_load(manager, worker, salt=43)
    release()
    deadline = time.monotonic() + 10
    while not worker._finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert timed_wait(worker) < 0.02
    assert worker.counters["idle_waits"] == 0


def test_ten_ms_by_default_and_zero_never_waits(rig):
    assert PykvConfig.from_extra_config({"root": "/tmp"}).idle_wait_ms == 10  # run 27: on by default
    manager, worker, _ = rig(idle_wait_ms=0)
    assert worker.pykv.idle_wait_ms == 0
    _, release = stored_then_held_load(manager, worker, salt=44)
    assert timed_wait(worker) < 0.005
    assert worker.counters["idle_waits"] == 0
    release()
    run(worker, 2)


@pytest.mark.parametrize("value", [-1, 50.5, "soon", True, float("nan")])
def test_idle_wait_ms_out_of_bounds_is_one_line(value):
    with pytest.raises(InputError, match="idle_wait_ms"):
        PykvConfig.from_extra_config({"root": "/tmp", "idle_wait_ms": value})


# -- the connector: scheduler marks idle steps, the worker side waits on them only ----------------------
def _meta() -> OffloadingConnectorMetadata:
    return OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush=set())


def test_the_scheduler_marks_steps_that_schedule_no_tokens(monkeypatch):
    import pickle
    monkeypatch.setattr(OffloadingConnector, "build_connector_meta", lambda self, out: _meta())
    monkeypatch.setattr(PykvOffloadingConnector, "_preload_manager", lambda self: None)
    connector = object.__new__(PykvOffloadingConnector)
    idle = connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
    busy = connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=3))
    assert isinstance(idle, PykvConnectorMetadata) and idle.idle and not idle.preloads
    assert pickle.loads(pickle.dumps(idle)).idle  # it crosses to workers in other processes
    assert not getattr(busy, "idle", False)


def test_the_worker_side_waits_on_idle_steps_only(monkeypatch):
    waits = []
    worker = SimpleNamespace(wait_idle_step=lambda: waits.append(1), take_failed_load_jobs=lambda: set())
    monkeypatch.setattr(OffloadingConnector, "get_finished", lambda self, ids: (set(), set()))
    monkeypatch.setattr(PykvOffloadingConnector, "_pykv_worker", property(lambda self: worker))
    monkeypatch.setattr(PykvOffloadingConnector, "_request_level_failures", lambda self: False)
    connector = object.__new__(PykvOffloadingConnector)
    connector.connector_worker = None
    for meta, waited in ((PykvConnectorMetadata.wrap(_meta(), {}, (), idle=True), 1),
                         (PykvConnectorMetadata.wrap(_meta(), {}, (), idle=False), 0), (_meta(), 0), (None, 0)):
        waits.clear()
        connector._connector_metadata = meta
        assert connector.get_finished(set()) == (set(), set())
        assert len(waits) == waited
