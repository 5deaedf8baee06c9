"""PykvManager + PykvWorker on CPU tensors, without an engine: the round trip vLLM drives."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from pykv.format import HEADER_SIZE  # noqa: E402

from pykv.connector.compat import CanonicalKVCaches, GPULoadStoreSpec, OffloadingConfig, ReqContext  # noqa: E402
from pykv.config import PykvConfig  # noqa: E402
from pykv.connector.manager import PykvManager  # noqa: E402
from pykv.connector.spec import WorkerReport  # noqa: E402
from pykv.connector.worker import PykvWorker  # noqa: E402
from worker_helpers import hold_writes, settle_stores  # noqa: E402
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor, LookupResult  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

LAYERS, BLOCKS, PAGE, BPC, TOKENS = 3, 64, 4096, 4, 16


def offloading_config(root: str, **extra) -> OffloadingConfig:
    os.makedirs(root, exist_ok=True)  # the tree's directory, as `pykv init` makes it: engines never create a root
    group = OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=tuple(f"l{i}" for i in range(LAYERS)),
                                  group_id=0)
    parallel = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=False)
    return OffloadingConfig(groups=(group,), worker_kv_bytes_per_block=LAYERS * PAGE, enable_kv_cache_events=False,
                            extra_config={"root": root, "staging_bytes": "1M", **extra}, engine_id="e",
                            model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
                            cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=BPC),
                            parallel=parallel, kv_cache_layout="LBHNC")


def kv_caches() -> CanonicalKVCaches:
    tensors = [CanonicalKVCacheTensor(torch.zeros(BLOCKS, PAGE, dtype=torch.int8), PAGE) for _ in range(LAYERS)]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])


@pytest.fixture
def rig(tmp_path):
    def make(**extra):
        config = offloading_config(str(tmp_path / "tree"), **extra)
        pykv = PykvConfig.from_extra_config(config.extra_config)
        caches = kv_caches()
        manager = PykvManager(config, pykv)
        worker = PykvWorker(config, pykv, caches)
        made.append(worker)
        return manager, worker, [t.tensor for t in caches.tensors]
    made: list[PykvWorker] = []
    yield make
    for w in made:
        w.shutdown()


def run(worker: PykvWorker, job: int, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = worker.get_finished()
        if done:
            assert [r.job_id for r in done] == [job] and done[0].success
            return worker.get_block_ids_with_load_errors(), worker.take_report()
        time.sleep(0.01)
    raise TimeoutError(job)


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 16 + (0).to_bytes(4, "big") for i in range(n)]


def test_store_then_load_round_trip_with_partial_first_chunk(rig):
    manager, worker, kv = rig()
    ctx = ReqContext("r")
    for t, layer in enumerate(kv):
        layer.copy_(torch.randint(-128, 127, layer.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(t)))
    expected = [layer.clone() for layer in kv]
    ks = keys(3)
    out = manager.prepare_store(ks, ctx)
    assert out.keys_to_store == ks
    src = GPULoadStoreSpec(list(range(1, 13)), group_sizes=[12], block_indices=[0])
    worker.submit_store(1, src, out.store_spec)
    failed, report = run(worker, 1)
    assert not failed and not report
    manager.complete_store(ks, ctx)
    assert all(manager.lookup(k, ctx) is LookupResult.HIT for k in ks)
    assert manager.prepare_store(ks, ctx).keys_to_store == []  # already on disk: skipped

    for layer in kv:
        layer.zero_()
    # a GPU prefix hit of 2 blocks: load starts mid-chunk (skip 2 of chunk 0)
    spec = manager.prepare_load(ks, ctx)
    dst = GPULoadStoreSpec(list(range(30, 40)), group_sizes=[10], block_indices=[2])
    worker.submit_load(2, spec, dst)
    failed, report = run(worker, 2)
    assert not failed and not report
    for layer, want in zip(kv, expected):
        assert torch.equal(layer[30:40], want[3:13])
    assert worker.counters["load_blocks_disk"] == 3


def store_then_corrupt(manager, worker, ks: list[bytes], ctx, index: int):
    """Store ``ks`` (4 GPU blocks each) through the worker, then flip payload bytes of block ``index``."""
    blocks = 4 * len(ks)
    worker.submit_store(1, GPULoadStoreSpec(list(range(blocks)), [blocks], [0]),
                        manager.prepare_store(ks, ctx).store_spec)
    run(worker, 1)
    path = worker.devices[0].block_path(worker.namespace.id, ks[index])
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 10)
        f.write(b"\xff\xfe")
    return path


def test_corrupt_file_fails_that_chunk_and_later_ones_and_is_quarantined(rig):
    manager, worker, kv = rig()
    ctx = ReqContext("r")
    ks = keys(3, salt=1)
    path = store_then_corrupt(manager, worker, ks, ctx, 1)
    worker.submit_load(2, manager.prepare_load(ks, ctx), GPULoadStoreSpec(list(range(20, 32)), [12], [0]))
    failed, report = run(worker, 2)
    assert failed == set(range(24, 32))
    assert report.failed_loads == [ks[1]]
    assert not path.exists() and worker.counters["quarantined"] == 1
    manager.on_worker_report(report)
    assert manager.lookup(ks[1], ctx) is LookupResult.MISS


def store_through_dram(manager, worker, kv, ks: list[bytes], ctx, value: int) -> None:
    """GPU blocks 0..11, filled with ``value``, stored (job 1) through DRAM-tier slots and committed."""
    for layer in kv:
        layer[:12].fill_(value)
    out = manager.prepare_store(ks, ctx)
    assert all(s >= 0 for s in out.store_spec.dram_slots)
    worker.submit_store(1, GPULoadStoreSpec(list(range(12)), [12], [0]), out.store_spec)
    _, report = run(worker, 1)
    manager.on_worker_report(report)
    manager.complete_store(ks, ctx)
    settle_stores(manager, worker, ks)


def test_dram_hit_reads_no_disk(rig):
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(3, salt=2)
    store_through_dram(manager, worker, kv, ks, ctx, 7)
    for k in ks:  # remove the files: only DRAM can serve now
        os.unlink(worker.devices[0].block_path(worker.namespace.id, k))
    spec = manager.prepare_load(ks, ctx)
    assert spec.resident == (True, True, True)
    worker.submit_load(2, spec, GPULoadStoreSpec(list(range(40, 52)), [12], [0]))
    failed, _ = run(worker, 2)
    manager.complete_load(ks, ctx)
    assert not failed
    assert worker.counters["load_blocks_dram"] == 3 and worker.counters["load_blocks_disk"] == 0
    assert all(bool((layer[40:52] == 7).all()) for layer in kv)


def test_dram_hit_skips_the_reactor_and_a_bad_slot_fails_only_its_blocks(rig):
    """A wholly resident load is copied from the engine thread in one batch; a slot whose header
    is damaged is refused (recomputed from that block on) and never copied."""
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(3, salt=9)
    store_through_dram(manager, worker, kv, ks, ctx, 5)
    spec = manager.prepare_load(ks, ctx)
    assert spec.resident == (True, True, True)
    reactor_delivered = worker.reactor.stats["delivered_blocks"]
    slot = worker.dram_base + spec.dram_slots[1]
    worker.pool.view(slot)[HEADER_SIZE - 64] ^= 0xFF  # header bytes: its checksum no longer matches
    worker.submit_load(2, spec, GPULoadStoreSpec(list(range(40, 52)), [12], [0]))
    failed, report = run(worker, 2)
    manager.complete_load(ks, ctx)
    assert failed == set(range(44, 52))  # chunk 1 and everything after it is recomputed
    assert report.failed_loads == [ks[1]]
    assert bool((kv[0][40:44] == 5).all()) and not bool((kv[0][44:48] == 5).any())  # chunk 1 not copied
    assert worker.reactor.stats["delivered_blocks"] == reactor_delivered  # no reactor round trip
    assert worker.counters["dram_delivered_blocks"] == 2
    assert worker.counters["load_blocks_dram"] == 2 and worker.counters["load_blocks_failed_dram"] == 1


def test_a_load_half_in_dram_copies_that_half_at_once_and_reads_only_the_rest(rig):
    """Chunks 0 and 2 in the DRAM tier, chunk 1 only on disk: one job, split in two parts."""
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(3, salt=11)
    store_through_dram(manager, worker, kv, ks, ctx, 6)
    manager.dram.drop(ks[1])  # the middle chunk left the DRAM tier; its file stays
    spec = manager.prepare_load(ks, ctx)
    assert spec.resident == (True, False, True)
    before = dict(worker.reactor.stats)
    worker.submit_load(2, spec, GPULoadStoreSpec(list(range(40, 52)), [12], [0]))
    failed, report = run(worker, 2)
    manager.complete_load(ks, ctx)
    assert not failed and not report
    assert all(bool((layer[40:52] == 6).all()) for layer in kv)
    assert worker.counters["dram_delivered_blocks"] == 2  # the DRAM part never went through the reactor
    assert worker.reactor.stats["delivered_blocks"] - before["delivered_blocks"] == 1
    assert worker.reactor.stats["disk_reads"] - before["disk_reads"] == 1
    assert worker.counters["load_blocks_dram"] == 2 and worker.counters["load_blocks_disk"] == 1
    assert worker.store.open_jobs == 0  # the job and both parts are gone


def test_a_split_load_reports_failures_at_their_place_in_the_job(rig):
    """The disk part fails (file gone): its chunk and every later one are recomputed (the DRAM
    chunk after it too, although it was copied), and the DRAM chunk before it is kept."""
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(3, salt=12)
    store_through_dram(manager, worker, kv, ks, ctx, 4)
    manager.dram.drop(ks[1])
    os.unlink(worker.devices[0].block_path(worker.namespace.id, ks[1]))
    spec = manager.prepare_load(ks, ctx)
    worker.submit_load(2, spec, GPULoadStoreSpec(list(range(40, 52)), [12], [0]))
    failed, report = run(worker, 2)
    manager.complete_load(ks, ctx)
    assert failed == set(range(44, 52))
    assert report.failed_loads == [ks[1]]
    assert bool((kv[0][40:44] == 4).all())
    assert worker.counters["load_blocks_failed_disk"] == 1 and worker.counters["load_blocks_dram"] == 2


def test_store_failure_pauses_stores_and_leaves_no_partial_files(rig, tmp_path):
    manager, worker, kv = rig()
    ctx = ReqContext("r")
    ks = keys(2, salt=3)
    ns_dir = worker.devices[0].namespace_dir(worker.namespace.id)
    os.chmod(ns_dir, 0o500)
    try:
        if os.access(ns_dir, os.W_OK):  # root ignores modes: make the shard dirs impossible instead
            for k in ks:
                shard = worker.devices[0].block_path(worker.namespace.id, k).parent.parent
                shard.parent.mkdir(parents=True, exist_ok=True)
                shard.write_text("not a directory")
        worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), manager.prepare_store(ks, ctx).store_spec)
        _, report = run(worker, 1)
    finally:
        os.chmod(ns_dir, 0o700)
    assert report.store_error and len(report.failed_stores) == 2
    manager.on_worker_report(report)
    assert manager.prepare_store(keys(2, salt=4), ctx).keys_to_store == []
    names = [n for _, _, files in os.walk(worker.devices[0].root) for n in files]
    assert not [n for n in names if ".tmp." in n]


def test_the_manager_evicts_and_stores_nothing_while_eviction_is_behind(rig, tmp_path):
    from treefactory import BLOCK_SIZE, add_block, key, set_mtime

    from pykv.counters import Metric
    from pykv.tree import KVTree

    manager, worker, kv = rig(max_tree_bytes=8 * BLOCK_SIZE, evict_interval="1h", evict_min_age="1h")
    try:
        manager.evictor.close()  # its thread, started by the manager: this test runs the rounds itself
        ctx = ReqContext("r")
        tree = KVTree.open(tmp_path / "tree")
        young = [add_block(tree, key(i), published_ago=5) for i in range(12)]  # another engine's fresh blocks
        manager.evictor.run_once()
        assert manager.evictor.behind and all(p.exists() for p in young)  # too young to evict
        assert manager.prepare_store(keys(2), ctx).keys_to_store == []  # as on a full disk: skipped, counted
        assert manager.counters[Metric.STORES_OVER_LIMIT] == 2
        for p in young:
            set_mtime(p, 7200)
        manager.evictor.run_once()
        assert not manager.evictor.behind and sum(p.exists() for p in young) == 7  # low water: 7.2 blocks
        ks = keys(2)
        out = manager.prepare_store(ks, ctx)
        assert out.keys_to_store == ks
        worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), out.store_spec)
        run(worker, 1)
        manager.complete_store(ks, ctx)  # tells the evictor what the tree grew by (at most)
        assert manager.evictor._stored == 2 * manager._block_bytes >= manager.evictor.policy.trigger_bytes
        exported = manager.get_stats().data["data"]  # what vLLM puts on /metrics
        assert exported[Metric.EVICTED_BLOCKS] == {(): 5} and exported[Metric.EVICT_ROUNDS] == {(): 2}
        assert exported[Metric.EVICTED_BYTES] == {(): 5 * BLOCK_SIZE}
    finally:
        manager.shutdown()
    assert not manager.evictor._thread.is_alive()
    manager.shutdown()  # vLLM's connector and pykv's may both call it
    assert rig()[0].evictor is None  # no max_tree_bytes: no evictor, no thread


def test_the_evictors_gauges_reach_vllms_registry_at_most_once_a_second(rig, tmp_path):
    from dashboard import exposition_samples, vllm_registry
    from prometheus_client import generate_latest
    from treefactory import BLOCK_SIZE, add_block, key

    from pykv.counters import Gauge
    from pykv.tree import KVTree

    (tmp_path / "tree").mkdir(exist_ok=True)
    manager, worker, kv = rig(max_tree_bytes=8 * BLOCK_SIZE, evict_interval="1h", evict_min_age="1h")
    now = [1000.0]
    manager._clock = lambda: now[0]
    registry, metrics = vllm_registry(manager.config.extra_config)
    try:
        manager.evictor.close()  # this test runs the rounds itself
        tree = KVTree.open(tmp_path / "tree")
        for i in range(12):
            add_block(tree, key(i), published_ago=5)
        manager.evictor.run_once()
        ks = keys(2)
        manager.complete_store(ks, ReqContext("r"))
        metrics.observe(manager.get_stats().data, 0)  # what vLLM's API server does with each step's stats
        samples = exposition_samples(generate_latest(registry).decode())
        assert samples["pykv:tree_bytes"] == [({"device": "0", "engine": "0", "model_name": "m"}, 12 * BLOCK_SIZE)]
        assert samples["pykv:tree_blocks"][0][1] == 12 and samples["pykv:evict_behind"][0][1] == 1
        assert samples["pykv:quarantine_files"][0][1] == 0 and samples["pykv:stored_blocks_total"][0][1] == 2
        assert samples["pykv:tree_limit_bytes"][0][1] == 8 * BLOCK_SIZE  # set at start, never reported again
        manager.complete_store(keys(1, salt=1), ReqContext("r"))
        now[0] += 0.5
        assert Gauge.TREE_BYTES not in manager.get_stats().data["data"]  # a step's counters only: not yet due
        now[0] += 0.5
        assert manager.get_stats().data["data"][Gauge.EVICT_ROUND_AGE] == {("0",): pytest.approx(0, abs=5)}
        assert manager.get_stats() is None  # no new counts, gauges not due
    finally:
        manager.shutdown()
    assert rig()[0].get_stats() is None  # no eviction: its gauges keep their start values, nothing to send


def _waiter(worker: PykvWorker, job_ids: set[int]):
    import threading
    thread = threading.Thread(target=worker.wait, args=(job_ids,), daemon=True)
    thread.start()
    return thread


def test_wait_releases_a_store_once_its_blocks_are_copied_out_not_when_written(rig):
    """vLLM calls wait() before reusing a finished request's GPU blocks; the disk write must not stall it."""
    manager, worker, kv = rig()
    ks = keys(2, salt=7)
    held, filled = [], worker.reactor.filled
    worker.reactor.filled = lambda transfer, ok=True, stored=None: held.append((transfer, ok, stored))  # writes wait
    worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), manager.prepare_store(ks, ReqContext("r")).store_spec)
    waiter = _waiter(worker, {1})
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "wait() blocked on a store whose blocks were already in host slots"
    assert len(held) == 2 and worker.get_finished() == []  # copied out, nothing written yet
    for transfer, ok, stored in held:
        filled(transfer, ok, stored)
    failed, report = run(worker, 1)
    assert not failed and not report and worker.counters["store_published"] == 2


def _wait_blocks_until_released(worker: PykvWorker, job: int, held: list, wanted: int, release, why: str) -> None:
    """``wait({job})`` blocks while the ``wanted`` copies the test intercepted into ``held`` are
    held back, and returns once ``release`` has run them."""
    waiter = _waiter(worker, {job})
    deadline = time.monotonic() + 10
    while len(held) < wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    waiter.join(timeout=0.3)
    assert waiter.is_alive(), why
    for tasks, done in held:
        release(tasks, done)
    waiter.join(timeout=10)
    assert not waiter.is_alive()


def test_wait_holds_a_store_until_its_copies_end_and_a_load_until_it_ends(rig):
    manager, worker, kv = rig()
    ks = keys(2, salt=8)
    copies, to_slots = [], worker.copier.to_slots
    worker.copier.to_slots = lambda tasks, done: copies.append((tasks, done))  # device-to-host copies held
    worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), manager.prepare_store(ks, ReqContext("r")).store_spec)
    _wait_blocks_until_released(worker, 1, copies, 2, to_slots,
                                "wait() returned while the GPU blocks were still being read")
    run(worker, 1)
    manager.complete_store(ks, ReqContext("r"))

    delivered, deliver = [], worker.copier.from_slots
    worker.copier.from_slots = lambda tasks, done: delivered.append((tasks, done))  # host-to-device copies held
    worker.submit_load(2, manager.prepare_load(ks, ReqContext("r")), GPULoadStoreSpec(list(range(8)), [8], [0]))
    _wait_blocks_until_released(worker, 2, delivered, 1, deliver,
                                "wait() returned before a load had written its GPU blocks")
    run(worker, 2)


def test_a_store_through_dram_is_a_hit_while_its_files_are_still_written(rig, monkeypatch):
    """Early release: vLLM gets the store job once the blocks are in their DRAM slots; the slots
    stay pinned until the worker reports the end of the writes."""
    backends = hold_writes(monkeypatch)  # sealed blocks, but no write starts yet
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(3, salt=9)
    for layer in kv:
        layer[:12].fill_(3)
    worker.submit_store(1, GPULoadStoreSpec(list(range(12)), [12], [0]), manager.prepare_store(ks, ctx).store_spec)
    failed, report = run(worker, 1)  # finished for vLLM with every write still held
    assert not failed and not report.stores_ended
    deadline = time.monotonic() + 20  # released once sealed: the reactor issues the writes right after
    while len(backends[0].held) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(backends[0].held) == 3
    manager.complete_store(ks, ctx)
    assert all(manager.lookup(k, ctx) is LookupResult.HIT for k in ks)
    assert not any(worker.devices[0].contains(worker.namespace.id, k) for k in ks)  # DRAM hits only
    assert all(manager.dram.entry(k).pins == 1 for k in ks)  # the writes still read the slots

    spec = manager.prepare_load(ks, ctx)  # a later turn of the conversation loads them from DRAM
    assert spec.resident == (True, True, True)
    worker.submit_load(2, spec, GPULoadStoreSpec(list(range(40, 52)), [12], [0]))
    assert not run(worker, 2)[0]
    manager.complete_load(ks, ctx)
    assert all(bool((layer[40:52] == 3).all()) for layer in kv)

    backends[0].release()
    settle_stores(manager, worker, ks)
    assert all(manager.dram.entry(k).pins == 0 for k in ks) and not manager.residency.writes()
    assert all(worker.devices[0].contains(worker.namespace.id, k) for k in ks)
    assert worker.counters["store_jobs_released_early"] == 1 and worker.counters["store_published"] == 3


def test_a_write_that_ends_before_vllm_completes_the_store_unpins_at_completion(rig):
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(2, salt=10)
    worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), manager.prepare_store(ks, ctx).store_spec)
    _, report = run(worker, 1)
    deadline = time.monotonic() + 20
    while len(report.stores_ended) < len(ks) and time.monotonic() < deadline:
        time.sleep(0.01)
        report = report.merge(worker.take_report())
    assert sorted(report.stores_ended) == sorted((k, 0) for k in ks)
    manager.on_worker_report(report)  # the end of the writes first ...
    manager.complete_store(ks, ctx)  # ... then vLLM's completion
    assert all(manager.dram.entry(k).pins == 0 and manager.dram.lookup(k) is not None for k in ks)
    assert manager.residency.writes() == {}


def test_a_slot_still_written_is_never_reused_even_when_its_entry_is_forgotten(rig):
    """A failed DRAM load (or reset_cache) while the file is written from the slot: the entry
    misses from then on, but its slot is freed only when the write ends."""
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(2, salt=11)
    out = manager.prepare_store(ks, ctx)
    slots = set(out.store_spec.dram_slots)
    manager.complete_store(ks, ctx)  # early release: the writes have not ended
    assert set(manager.residency.writes()) == set(ks)
    spec = manager.prepare_load(ks[:1], ctx)  # a DRAM load of the first block fails ...
    assert spec.resident == (True,)
    report = WorkerReport()
    report.failed_loads = [ks[0]]
    manager.on_worker_report(report)
    manager.complete_load(ks[:1], ctx)  # ... and its completion does not make it a hit again
    assert manager.lookup(ks[0], ctx) is LookupResult.MISS
    manager.reset_cache()
    manager.on_reset_flushed()  # no vLLM job in flight at the reset: vLLM (or the connector before 0.33) says so
    assert all(manager.lookup(k, ctx) is LookupResult.MISS for k in ks)
    others = keys(manager.dram.capacity, salt=12)
    taken = {s for s in manager.prepare_store(others, ctx).store_spec.dram_slots if s >= 0}
    assert not taken & slots and len(taken) == manager.dram.capacity - 2
    ended = WorkerReport()
    ended.stores_ended = [(k, 0) for k in ks]
    manager.on_worker_report(ended)
    assert all(manager.dram.entry(k) is None for k in ks) and manager.dram.free_slots == 2


def test_the_end_of_early_released_writes_reaches_the_stats_file_without_another_step(rig, tmp_path, monkeypatch):
    """vLLM stops polling an idle engine once it has every job; the writes that outlive an early
    release must still show in the counters (``pykv calibrate`` waits on them between lengths)."""
    import json

    monkeypatch.setenv("PYKV_STATS_FILE", str(tmp_path / "stats"))
    backends = hold_writes(monkeypatch)
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(3, salt=12)
    worker.submit_store(1, GPULoadStoreSpec(list(range(12)), [12], [0]), manager.prepare_store(ks, ctx).store_spec)
    run(worker, 1)  # vLLM's last get_finished: the job is done for it, its writes are not
    path = tmp_path / "stats.worker0.json"
    assert worker._stats_file.flush()
    assert json.loads(path.read_text())["jobs_in_flight"] == 1

    backends[0].release()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # no get_finished from here on
        stats = json.loads(path.read_text())
        if stats["jobs_in_flight"] == 0:
            break
        time.sleep(0.02)
    assert stats["jobs_in_flight"] == 0 and stats["store_published"] == 3


def test_idle_get_finished_calls_do_not_gather_the_counters_but_a_new_job_does(rig, tmp_path, monkeypatch):
    """vLLM calls ``get_finished`` many times per step: the counters are gathered only when jobs
    came or went (or every ``STATS_INTERVAL_S``), and a new job still reaches the file at once."""
    import json

    from pykv.connector import worker as worker_module
    monkeypatch.setenv("PYKV_STATS_FILE", str(tmp_path / "stats"))
    monkeypatch.setattr(worker_module, "STATS_INTERVAL_S", 60.0)
    hold_writes(monkeypatch)
    manager, worker, kv = rig()
    gathered = []
    stats = worker.store.stats
    monkeypatch.setattr(worker.store, "stats", lambda: gathered.append(1) or stats())
    for _ in range(200):
        assert worker.get_finished() == []
    assert len(gathered) == 1  # the first call (nothing written yet)
    ks = keys(2, salt=31)
    worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), manager.prepare_store(ks, ReqContext("r")).store_spec)
    worker.get_finished()
    assert len(gathered) == 2 and worker._stats_file.flush()
    assert json.loads((tmp_path / "stats.worker0.json").read_text())["jobs_in_flight"] == 1


def test_a_reader_instance_loads_what_a_writer_stored_and_stores_nothing(rig):
    """``store: false``: another instance's blocks load as usual; new KV is never written."""
    writer, writer_worker, kv = rig()
    ctx = ReqContext("r")
    for layer in kv:
        layer[:8].fill_(5)
    stored = keys(2, salt=13)
    writer_worker.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]),
                               writer.prepare_store(stored, ctx).store_spec)
    run(writer_worker, 1)
    writer.complete_store(stored, ctx)

    reader, reader_worker, reader_kv = rig(store="false")
    fresh = keys(2, salt=14)
    out = reader.prepare_store(stored + fresh, ctx)
    assert out.keys_to_store == [] and reader.counters["pykv:stores_off"] == 4
    assert not any(reader.devices[0].contains(reader.namespace.id, k) for k in fresh)
    assert all(reader.lookup(k, ctx) is LookupResult.HIT for k in stored)
    reader_worker.submit_load(2, reader.prepare_load(stored, ctx), GPULoadStoreSpec(list(range(20, 28)), [8], [0]))
    assert not run(reader_worker, 2)[0]
    assert all(bool((layer[20:28] == 5).all()) for layer in reader_kv)


def test_a_corrupt_block_is_left_in_place_when_a_planted_link_blocks_its_quarantine(rig, tmp_path):
    """A symlinked ``.pykv/quarantine`` makes the quarantine fail; the worker must neither follow the
    link nor fall back to deleting the file (it may not be pykv's): the load still fails cleanly."""
    manager, worker, kv = rig()
    ctx = ReqContext("r")
    ks = keys(2, salt=7)
    path = store_then_corrupt(manager, worker, ks, ctx, 0)
    outside = tmp_path / "outside"
    outside.mkdir()
    quarantine = worker.devices[0].state_dir / "quarantine"
    quarantine.parent.mkdir(exist_ok=True)
    if quarantine.exists():
        quarantine.rmdir()
    quarantine.symlink_to(outside)
    worker.submit_load(2, manager.prepare_load(ks, ctx), GPULoadStoreSpec(list(range(20, 28)), [8], [0]))
    failed, report = run(worker, 2)
    assert failed == set(range(20, 28)) and report.failed_loads == [ks[0]]
    assert path.exists() and worker.counters["quarantined"] == 0
    assert list(outside.iterdir()) == []


def test_every_load_job_counts_its_wall_time_and_bytes_from_dram_and_from_disk(rig):
    """``load_job_us`` / ``load_job_max_us`` / ``load_job_bytes``: what the H200 benchmark reads."""
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(3, salt=15)
    store_through_dram(manager, worker, kv, ks, ctx, 2)
    manager.dram.drop(ks[1])  # the second block loads from disk
    worker.submit_load(2, manager.prepare_load(ks[:1], ctx), GPULoadStoreSpec(list(range(40, 44)), [4], [0]))
    run(worker, 2)
    worker.submit_load(3, manager.prepare_load(ks[1:2], ctx), GPULoadStoreSpec(list(range(44, 48)), [4], [0]))
    run(worker, 3)
    block = worker.counters["dram_delivered_bytes"]
    assert block > 0 and worker.counters["load_job_bytes"] == 2 * block  # one block from DRAM, one from disk
    assert worker.counters["load_jobs"] == 2
    assert 0 < worker.counters["load_job_max_us"] <= worker.counters["load_job_us"]


def test_with_a_key_stores_through_dram_are_signed_and_a_fresh_worker_loads_them(rig, tmp_path):
    """auth_key_file: a store through DRAM slots is sealed and signed on the verifier threads before
    it is released; its files are signed (v2, the write key's id) and load from disk in a new pair."""
    from pykv.auth import write_key_file
    from pykv.blockfile import read_header
    write_key_file(tmp_path / "keys", {"k1": bytes(range(32))})
    manager, worker, kv = rig(dram_bytes="2M", auth_key_file=str(tmp_path / "keys"))
    ctx = ReqContext("r")
    ks = keys(3, salt=4)
    store_through_dram(manager, worker, kv, ks, ctx, 9)
    for k in ks:
        assert read_header(worker.devices[0].block_path(worker.namespace.id, k)).key_id == b"k1"
    manager, worker, kv = rig(auth_key_file=str(tmp_path / "keys"))
    spec = manager.prepare_load(ks, ctx)
    worker.submit_load(2, spec, GPULoadStoreSpec(list(range(40, 52)), [12], [0]))
    failed, _ = run(worker, 2)
    assert not failed and worker.counters["load_blocks_disk"] == 3
    assert all(bool((layer[40:52] == 9).all()) for layer in kv)


def test_a_manager_refuses_to_start_with_a_key_file_others_may_read(tmp_path):
    from pykv.auth import KeyFileError, write_key_file
    write_key_file(tmp_path / "keys", {"k1": bytes(range(32))})
    os.chmod(tmp_path / "keys", 0o604)
    config = offloading_config(str(tmp_path / "tree"), auth_key_file=str(tmp_path / "keys"))
    with pytest.raises(KeyFileError, match="kv_connector_extra_config.auth_key_file .*: mode 0604"):
        PykvManager(config, PykvConfig.from_extra_config(config.extra_config))


def test_wait_sheds_a_store_that_finds_no_free_slot_and_the_manager_learns_it_failed(rig, monkeypatch):
    """A store that queues behind a disk which cannot keep up is dropped when vLLM needs its GPU
    blocks back: ``wait`` does not wait for writes, and the dropped blocks stay misses."""
    held = hold_writes(monkeypatch)  # no write ends: the slots of the first store stay busy
    manager, worker, kv = rig(staging_bytes="128K")
    slots = worker.store.pool.ledger.num_slots - worker.store.pool.ledger.reserved
    assert 1 <= slots <= 4
    first, second = keys(slots, salt=9), keys(2, salt=10)
    worker.submit_store(1, GPULoadStoreSpec(list(range(slots * BPC)), [slots * BPC], [0]),
                        manager.prepare_store(first, ReqContext("a")).store_spec)
    worker.submit_store(2, GPULoadStoreSpec(list(range(32, 40)), [8], [0]),
                        manager.prepare_store(second, ReqContext("b")).store_spec)
    waiter = _waiter(worker, {2})
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "wait() waited for the disk to free a staging slot"
    assert worker.counters["store_blocks_shed"] == 2
    held[0].release()
    report = run_jobs(worker, {1, 2})
    assert sorted(k for k, _ in report.failed_stores) == sorted(second)
    assert worker.counters["store_published"] == slots
    ctx = ReqContext("c")
    assert all(manager.lookup(k, ctx) is LookupResult.HIT for k in first)
    assert all(manager.lookup(k, ctx) is LookupResult.MISS for k in second)


def run_jobs(worker: PykvWorker, jobs: set[int], timeout: float = 20.0) -> WorkerReport:
    """Wait until all ``jobs`` finished (successfully for vLLM); the worker's report of them."""
    deadline, done = time.monotonic() + timeout, set()
    while done != jobs and time.monotonic() < deadline:
        for result in worker.get_finished():
            assert result.success
            done.add(result.job_id)
        time.sleep(0.01)
    assert done == jobs
    return worker.take_report()


def test_a_load_counts_the_time_from_its_end_until_vllm_collects_it(rig):
    """``load_report_wait_us``: a request waits this long after its KV is in place (vLLM polls
    ``get_finished`` once per step); a store's report adds nothing to it."""
    manager, worker, kv = rig(dram_bytes="2M")
    ctx = ReqContext("r")
    ks = keys(3, salt=21)
    store_through_dram(manager, worker, kv, ks, ctx, 1)
    assert worker.counters["load_report_wait_us"] == 0  # stores are not counted
    worker.submit_load(2, manager.prepare_load(ks[:1], ctx), GPULoadStoreSpec(list(range(40, 44)), [4], [0]))
    deadline = time.monotonic() + 20
    while worker.counters["load_job_bytes"] == 0:  # the job ended (counted at its end), not yet collected
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    assert [r.job_id for r in worker.get_finished()] == [2]
    assert worker.counters["load_report_wait_us"] >= 150_000  # at least the 0.2 s it sat uncollected
    assert worker.get_finished() == [] and worker.counters["load_report_wait_us"] < 20_000_000
    steps = [worker.counters[k] for k in ("load_submitted_ns", "load_ended_ns", "load_reported_ns")]
    assert manager.timing["load_planned_ns"] <= steps[0] <= steps[1] <= steps[2] - 150_000_000  # wall-clock gauges
