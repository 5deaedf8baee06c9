"""Preloading through PykvManager + PykvWorker on CPU tensors, driven the way vLLM's connector does.

The manager plans (``preload_candidate`` / ``take_preload_plan``), the worker reads
ahead (``submit_preloads``), the request's load claims the staged blocks. The last
test runs a round-robin multi-turn workload whose working set exceeds the DRAM tier
and checks the bounds: disk bytes read <= 1.1 x bytes delivered, staging and
speculation never above their bounds.
"""

from __future__ import annotations

import random
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from test_connector_worker import BLOCKS, BPC, kv_caches, offloading_config  # noqa: E402
from worker_helpers import settle_stores  # noqa: E402

from pykv.connector.compat import GPULoadStoreSpec, LookupResult, ReqContext  # noqa: E402
from pykv.config import PykvConfig  # noqa: E402
from pykv.connector.manager import PykvManager  # noqa: E402
from pykv.connector.spec import NO_SLOT, Metric  # noqa: E402
from pykv.connector.worker import PykvWorker  # noqa: E402


@pytest.fixture
def rig(tmp_path):
    made: list[PykvWorker] = []

    def make(**extra):
        config = offloading_config(str(tmp_path / "tree"), io_depth=2, open_ahead=4, **{"preload": True, **extra})
        pykv = PykvConfig.from_extra_config(config.extra_config)
        caches = kv_caches()
        manager, worker = PykvManager(config, pykv), PykvWorker(config, pykv, caches)
        made.append(worker)
        return manager, worker, [t.tensor for t in caches.tensors]
    yield make
    for w in made:
        w.shutdown()


def wait_jobs(worker: PykvWorker, jobs: set[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while jobs:
        assert time.monotonic() < deadline, f"jobs {jobs} did not finish"
        for result in worker.get_finished():
            assert result.success
            jobs.discard(result.job_id)
        time.sleep(0.005)
    assert not worker.get_block_ids_with_load_errors()


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def key(conversation: int, chunk: int) -> bytes:
    return bytes([conversation, chunk]) * 16 + (0).to_bytes(4, "big")


def gpu(first: int, chunks: int) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(range(first, first + chunks * BPC)), [chunks * BPC], [0])


def store(manager, worker, keys, job: int, first_block: int = 0) -> None:
    out = manager.prepare_store(keys, ReqContext("store"))
    if out.keys_to_store:
        worker.submit_store(job, gpu(first_block, len(out.keys_to_store)), out.store_spec)
        wait_jobs(worker, {job})
    manager.complete_store(out.keys_to_store, ReqContext("store"))
    settle_stores(manager, worker, out.keys_to_store)


def send_plan(manager, worker) -> None:
    plan = manager.take_preload_plan()
    worker.release_preloads(plan.released)
    worker.submit_preloads(plan.preloads)


def test_waiting_requests_sharing_a_prefix_read_it_once_and_claim_it(rig):
    manager, worker, kv = rig()
    for t, layer in enumerate(kv):
        layer.copy_(torch.randint(-128, 127, layer.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(t)))
    expected = [layer[0:3 * BPC].clone() for layer in kv]
    prefix = [key(9, c) for c in range(3)]
    store(manager, worker, prefix, job=1)
    for req in ("A", "B", "C"):  # three queued requests share the stored prefix (+ a miss of their own)
        manager.preload_candidate(req, prefix + [key(ord(req), 7)])
    send_plan(manager, worker)
    assert manager.counters[Metric.PRELOAD_REQUESTS] == 3
    until(lambda: worker.reactor.stats["preloads_started"] == 3)
    for layer in kv:
        layer.zero_()
    for job, req in enumerate(("A", "B", "C"), start=10):  # scheduled one after the other
        ctx = ReqContext(req)
        assert all(manager.lookup(k, ctx) is LookupResult.HIT for k in prefix)
        first = 20 + (job - 10) * 3 * BPC
        worker.submit_load(job, manager.prepare_load(prefix, ctx), gpu(first, 3))
        wait_jobs(worker, {job})
        manager.complete_load(prefix, ctx)
        send_plan(manager, worker)
        for layer, want in zip(kv, expected):
            assert torch.equal(layer[first:first + 3 * BPC], want)
    stats = worker.reactor.stats
    assert stats["disk_reads"] == 3  # one read per block for three requests
    assert stats["preloads_claimed"] == 9 and stats["preload_wasted_bytes"] == 0
    until(lambda: worker.pool.ledger.free == worker.pool.num_slots)  # all released


def test_a_waiting_request_that_is_aborted_releases_its_preloads(rig):
    manager, worker, _ = rig()
    keys = [key(3, c) for c in range(2)]
    store(manager, worker, keys, job=1)
    manager.preload_candidate("A", keys)
    send_plan(manager, worker)
    until(lambda: worker.reactor.policy.speculative_slots == 2)
    manager.on_request_finished(ReqContext("A"))  # aborted while waiting
    send_plan(manager, worker)
    until(lambda: worker.reactor.policy.speculative_slots == 0)
    assert worker.reactor.stats["preload_wasted_bytes"] > 0
    assert worker.pool.ledger.free == worker.pool.num_slots


def test_preloaded_keys_are_promoted_without_a_second_read_and_preloads_leave_the_dram_tier_alone(rig):
    manager, worker, _ = rig(dram_bytes="256K")  # 4 DRAM slots of ~52 KiB
    resident = [key(1, c) for c in range(2)]
    store(manager, worker, resident, job=1)  # stored through DRAM slots: DRAM hits now
    assert all(manager.dram.lookup(k) is not None for k in resident)
    on_disk = [key(2, c) for c in range(2)]
    manager.dram_before = dict.fromkeys(resident)
    store(manager, worker, on_disk, job=2)
    for k in on_disk:  # make them disk-only
        manager.dram.drop(k)
    dram_entries = {k: manager.dram.lookup(k) for k in resident}
    manager.preload_candidate("A", resident + on_disk)
    plan = manager.take_preload_plan()
    assert plan.preloads == {"A": tuple(on_disk)}  # DRAM hits need no read
    worker.submit_preloads(plan.preloads)
    until(lambda: worker.reactor.policy.speculative_slots == 2)
    assert {k: manager.dram.lookup(k) for k in resident} == dram_entries  # nothing evicted
    reads = worker.reactor.stats["disk_reads"]
    spec = manager.prepare_load(resident + on_disk, ReqContext("A"))
    assert all(slot != NO_SLOT for slot in spec.dram_slots[2:])  # promoted through the preload
    worker.submit_load(5, spec, gpu(40, 4))
    wait_jobs(worker, {5})
    assert worker.counters["load_blocks_dram"] == 2 and worker.reactor.stats["preloads_claimed"] == 2
    assert worker.reactor.stats["disk_reads"] == reads  # the preload's read was the only one
    manager.complete_load(resident + on_disk, ReqContext("A"))
    assert all(manager.dram.lookup(k) is not None for k in on_disk)  # the next hit is a DRAM hit


def test_round_robin_multi_turn_beyond_the_dram_tier_keeps_speculation_bounded(rig):
    """Conversations take turns; each turn's prompt is the previous one plus a chunk; a few
    requests wait at a time. Working set (5 x 6 chunks) >> DRAM tier (4 slots)."""
    manager, worker, _ = rig(dram_bytes="256K", preload_look_ahead=3, preload_max_bytes="160K")
    max_speculative = worker.reactor.config.max_speculative
    transient = worker.pool.num_slots - worker.pool.ledger.reserved
    conversations, turns = 5, 6
    rng = random.Random(0)
    job = 100
    queue: list[tuple[str, list[bytes]]] = []
    for turn in range(turns):
        for conv in range(conversations):
            queue.append((f"c{conv}t{turn}", [key(conv, c) for c in range(turn + 1)]))
    waiting: list[tuple[str, list[bytes]]] = []
    while queue or waiting:
        while queue and len(waiting) < 4:  # requests arrive and wait
            req, keys = queue.pop(0)
            manager.preload_candidate(req, keys)
            waiting.append((req, keys))
        send_plan(manager, worker)
        time.sleep(rng.random() * 0.01)  # some time passes: preloads progress
        req, keys = waiting.pop(0)  # the scheduler takes the oldest
        ctx = ReqContext(req)
        hits = 0
        while hits < len(keys) and manager.lookup(keys[hits], ctx) is LookupResult.HIT:
            hits += 1
        if hits:
            job += 1
            worker.submit_load(job, manager.prepare_load(keys[:hits], ctx), gpu(0, hits))
            wait_jobs(worker, {job})
            manager.complete_load(keys[:hits], ctx)
        manager.on_schedule_end(type("End", (), {"new_req_ids": [req]})())
        job += 1
        store(manager, worker, keys[hits:], job=job, first_block=0)  # the new turn's chunk
        manager.on_request_finished(ctx)
    send_plan(manager, worker)
    stats = worker.reactor.stats
    assert stats["preloads_claimed"] > 0
    assert stats["disk_read_bytes"] <= 1.1 * stats["delivered_bytes"], stats
    assert stats["slots_high"] <= transient
    assert stats["preload_slots_high"] <= max_speculative, (stats, max_speculative)
    until(lambda: worker.pool.ledger.free == transient)


def test_preload_plans_ride_on_vllms_metadata_and_keys_are_built_as_vllm_builds_them():
    import pickle
    from types import SimpleNamespace

    from pykv.connector.compat import OffloadingConnectorMetadata, make_offload_key
    from pykv.connector.connector import PykvConnectorMetadata, PykvOffloadingConnector

    base = OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush={7})
    meta = pickle.loads(pickle.dumps(PykvConnectorMetadata.wrap(base, {"r": (b"k",)}, ("gone",))))
    assert isinstance(meta, OffloadingConnectorMetadata)
    assert (meta.jobs_to_flush, meta.preloads, meta.released) == ({7}, {"r": (b"k",)}, ("gone",))

    connector = object.__new__(PykvOffloadingConnector)  # only the key builder is exercised
    groups = [SimpleNamespace(group_idx=0, hashes_per_chunk=2), SimpleNamespace(group_idx=3, hashes_per_chunk=2)]
    connector.connector_scheduler = SimpleNamespace(config=SimpleNamespace(kv_group_configs=groups))
    hashes = [bytes([i]) * 32 for i in range(5)]  # two full chunks and a half
    keys = connector.request_block_keys(SimpleNamespace(block_hashes=hashes))
    assert keys == [make_offload_key(hashes[1], 0), make_offload_key(hashes[1], 3),
                    make_offload_key(hashes[3], 0), make_offload_key(hashes[3], 3)]
