"""One ``PykvManager`` and several ``PykvWorker``s (tensor parallel ranks) on CPU tensors, without an
engine: what vLLM does between them, done here with the real messages.

Each step, every worker's finished jobs and ``WorkerReport`` go into a ``PykvWorkerMetadata``; the
workers' metadata are merged with its own ``aggregate`` (what vLLM's ``KVOutputAggregator`` calls),
in rank order or reversed; the manager gets the merged report first, then vLLM's completion of
every job all ranks have finished (``completed_jobs`` summed to the world size), as
``OffloadingConnectorScheduler.update_connector_output`` does. Each rank has its own random KV,
so a rank that read another rank's file would load bytes that are not its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from pykv.config import PykvConfig  # noqa: E402
from pykv.counters import Metric  # noqa: E402
from pykv.format import HEADER_SIZE  # noqa: E402

from pykv.connector.compat import (  # noqa: E402
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingWorkerMetadata,
    ReqContext,
)
from pykv.connector.connector import PykvWorkerMetadata  # noqa: E402
from pykv.connector.manager import PykvManager  # noqa: E402
from pykv.connector.messages import NO_SLOT  # noqa: E402
from pykv.connector.worker import PykvWorker  # noqa: E402
from reliability.connector_rig import BLOCKS, BPC, LAYERS, PAGE, chunk_keys, offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor  # noqa: E402
from worker_helpers import hold_writes  # noqa: E402

TP = 2


@dataclass
class Job:
    store: bool
    keys: list[bytes]
    due: int  # ranks that have not reported it finished
    failed_blocks: set[int] = field(default_factory=set)


class TPEngine:
    """A scheduler-side manager and ``tp`` workers on one tree; ``step`` plays vLLM's part."""

    def __init__(self, root: str, tp: int = TP, *, held: tuple[int, ...] = (), monkeypatch=None, seed: int = 0,
                 clock=time.monotonic, **extra) -> None:
        self.root, self.tp, self.ctx, self.order = root, tp, ReqContext("r"), list(range(tp))
        self.pykv = PykvConfig.from_extra_config(offloading_config(root, **extra).extra_config)
        self.manager = PykvManager(offloading_config(root, tp_size=tp, rank=0, **extra), self.pykv, clock=clock)
        self.workers: list[PykvWorker | None] = [None] * tp
        self.kv: list[list[torch.Tensor]] = [[] for _ in range(tp)]
        self.held = []
        for rank in sorted(range(tp), key=lambda r: r in held):  # hold_writes applies to every later store
            if rank in held and not self.held:
                self.held = hold_writes(monkeypatch)
            tensors = [CanonicalKVCacheTensor(torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8,
                                                            generator=torch.Generator().manual_seed(
                                                                1000 * seed + 10 * rank + t)), PAGE)
                       for t in range(LAYERS)]
            caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
            config = offloading_config(root, tp_size=tp, rank=rank, **extra)
            self.workers[rank] = PykvWorker(config, self.pykv, caches)
            self.kv[rank] = [t.tensor for t in tensors]
        self.jobs: dict[int, Job] = {}
        self._next_job = 0

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()

    # -- what the scheduler asks the workers to do ---------------------------------------------------
    def store(self, keys: list[bytes], first_block: int = 0) -> tuple[int, list[int]]:
        """Submit a store of ``keys`` to every rank; (job id, the DRAM slots it got)."""
        out = self.manager.prepare_store(keys, self.ctx)
        n = len(out.keys_to_store) * BPC
        job = self._job(Job(True, list(out.keys_to_store), self.tp))
        for worker in self.workers:
            worker.submit_store(job, GPULoadStoreSpec(list(range(first_block, first_block + n)), [n], [0]),
                                out.store_spec)
        return job, list(out.store_spec.dram_slots)

    def load(self, keys: list[bytes], first_block: int) -> int:
        spec = self.manager.prepare_load(keys, self.ctx)
        n = len(keys) * BPC
        job = self._job(Job(False, list(keys), self.tp))
        for worker in self.workers:
            worker.submit_load(job, spec, GPULoadStoreSpec(list(range(first_block, first_block + n)), [n], [0]))
        return job

    def _job(self, job: Job) -> int:
        self._next_job += 1
        self.jobs[self._next_job] = job
        return self._next_job

    # -- what vLLM does with the workers' outputs ----------------------------------------------------
    def step(self) -> None:
        metas = []
        for rank in self.order:
            worker = self.workers[rank]
            base = OffloadingWorkerMetadata()
            for result in worker.get_finished():
                base.mark_completed(result.job_id)
            failed = worker.get_block_ids_with_load_errors()
            for job in base.completed_jobs:
                self.jobs[job].failed_blocks |= failed
            metas.append(PykvWorkerMetadata.wrap(base, worker.take_report()))
        merged = metas[0]
        for meta in metas[1:]:
            merged = merged.aggregate(meta)
        if merged.report:
            self.manager.on_worker_report(merged.report)
        for job_id, count in merged.completed_jobs.items():
            job = self.jobs[job_id]
            job.due -= count
            assert job.due >= 0
            if job.due == 0:
                (self.manager.complete_store if job.store else self.manager.complete_load)(job.keys, self.ctx)

    def until(self, done, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()
            time.sleep(0.005)

    def finish(self, job: int) -> Job:
        self.until(lambda: self.jobs[job].due == 0, f"job {job}")
        return self.jobs[job]

    def settle(self) -> None:
        """Until no write from a DRAM slot is left on any rank."""
        self.until(lambda: not self.manager.residency.writes(), "the writes to end")

    # -- the tree -------------------------------------------------------------------------------------
    def payload(self, rank: int, key: bytes) -> bytes | None:
        worker = self.workers[rank]
        path = worker.devices[0].block_path(worker.namespace.id, key)
        return path.read_bytes()[HEADER_SIZE:] if path.exists() else None

    def kv_bytes(self, rank: int, first_block: int) -> bytes:
        """What rank ``rank``'s storage block starting at GPU block ``first_block`` holds (file order)."""
        return b"".join(layer[first_block:first_block + BPC].contiguous().numpy().tobytes()
                        for layer in self.kv[rank])


@pytest.fixture
def engines(tmp_path):
    made: list[TPEngine] = []

    def make(tp: int = TP, **kwargs) -> TPEngine:
        made.append(TPEngine(str(tmp_path / "tree"), tp, **kwargs))
        return made[-1]
    yield make
    for engine in made:
        engine.close()


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["rank-order", "reversed"])
def test_a_dram_slot_is_reused_only_after_every_rank_reported_the_end_of_its_write(engines, monkeypatch, order):
    engine = engines(held=(1,), monkeypatch=monkeypatch, dram_bytes=str(5 * 36864))  # 5 DRAM slots
    engine.order = list(order)
    m = engine.manager
    ks = chunk_keys(3, salt=1)
    job, slots = engine.store(ks)
    assert NO_SLOT not in slots
    engine.finish(job)  # both ranks have the blocks in their slots: vLLM has the store (early release)
    assert all(m.lookup(k, engine.ctx) is LookupResult.HIT for k in ks)  # DRAM hits on every rank
    engine.until(lambda: all(engine.payload(0, k) is not None for k in ks), "rank 0's files")
    engine.until(lambda: all(m.residency.writes().get(k) == {0} for k in ks), "rank 0's ends")
    assert all(m.dram.entry(k).pins == 1 for k in ks)  # rank 1 still writes from its copy of each slot
    assert all(engine.payload(1, k) is None for k in ks)

    assert m.dram.capacity == 5
    others = chunk_keys(m.dram.capacity, salt=2)  # every other slot, then nothing: the written ones stay
    _, taken = engine.store(others, first_block=12)
    assert not set(taken) & set(slots) and taken.count(NO_SLOT) == len(ks)

    engine.held[0].release()
    engine.settle()
    assert all(m.dram.entry(k).pins == 0 and m.dram.lookup(k) == s for k, s in zip(ks, slots))
    assert all(engine.payload(r, k) is not None for r in range(TP) for k in ks)


def test_each_rank_writes_its_own_shard_and_a_fresh_engine_reads_each_rank_its_own(engines):
    writer = engines(dram_bytes="2M")
    ks = chunk_keys(3, salt=3)
    writer.finish(writer.store(ks)[0])
    writer.settle()
    namespaces = {w.namespace.id for w in writer.workers}
    assert len(namespaces) == TP and writer.manager.namespace.id == writer.workers[0].namespace.id
    for rank in range(TP):
        for i, k in enumerate(ks):
            assert writer.payload(rank, k) == writer.kv_bytes(rank, i * BPC)
    assert writer.kv_bytes(0, 0) != writer.kv_bytes(1, 0)

    reader = engines(seed=1, dram_bytes="2M")  # a fresh engine: disk hits, its own KV differs everywhere
    assert all(reader.manager.tier_of(k) == "disk" for k in ks)
    job = reader.load(ks, first_block=40)
    assert not reader.finish(job).failed_blocks
    for rank in range(TP):
        for i in range(len(ks)):
            assert reader.kv_bytes(rank, 40 + i * BPC) == writer.kv_bytes(rank, i * BPC)

    reader.manager.dram.drop(ks[0])  # promoted by that load; on disk only again
    reader.workers[1].devices[0].block_path(reader.workers[1].namespace.id, ks[0]).unlink()
    assert reader.manager.lookup(ks[0], reader.ctx) is LookupResult.MISS  # rank 1 could not serve it


def test_a_write_that_fails_on_one_rank_is_a_dram_hit_but_never_a_disk_hit(engines):
    now = [0.0]
    engine = engines(dram_bytes="2M", store_retry_interval="30s", clock=lambda: now[0])
    m, rank1 = engine.manager, engine.workers[1]
    ks = chunk_keys(2, salt=4)
    for k in ks:  # rank 1 cannot create the directory of these files
        shard = rank1.devices[0].block_path(rank1.namespace.id, k).parent.parent
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_text("not a directory")
    job, slots = engine.store(ks)
    engine.finish(job)
    engine.settle()
    assert all(engine.payload(0, k) is not None and engine.payload(1, k) is None for k in ks)
    assert m.counters[Metric.STORE_FAILURES] == len(ks)
    assert all(m.tier_of(k) == "dram" for k in ks)  # both ranks' slots hold the block
    for k in ks:
        m.dram.drop(k)
    assert all(m.lookup(k, engine.ctx) is LookupResult.MISS for k in ks)  # rank 0's file alone is no hit
    fresh = PykvManager(offloading_config(engine.root, tp_size=TP, rank=0, dram_bytes="2M"), engine.pykv)
    assert all(fresh.lookup(k, engine.ctx) is LookupResult.MISS for k in ks)

    # rank 1 pauses its stores after that failure; the scheduler's pause is over: rank 1 refuses the
    # next store outright (its slot never holds the block), rank 0 runs it.
    now[0] += 60
    more = chunk_keys(2, salt=5)
    job, slots = engine.store(more, first_block=20)
    assert NO_SLOT not in slots
    engine.finish(job)
    engine.settle()
    assert all(m.lookup(k, engine.ctx) is LookupResult.MISS for k in more)
    assert all(m.dram.entry(k) is None for k in more) and m.dram.free_slots == m.dram.capacity


def test_a_tree_written_with_one_worker_is_never_read_by_two(engines):
    single = engines(tp=1, dram_bytes="2M")
    ks = chunk_keys(2, salt=6)
    single.finish(single.store(ks)[0])
    single.settle()
    assert all(single.manager.on_disk(k) for k in ks)
    pair = engines(dram_bytes="2M")
    assert single.workers[0].namespace.id not in {w.namespace.id for w in pair.workers}
    assert all(pair.manager.lookup(k, pair.ctx) is LookupResult.MISS for k in ks)
    _, slots = pair.store(ks)  # and stored again, under the two ranks' own namespaces
    assert NO_SLOT not in slots
