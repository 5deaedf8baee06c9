"""``PykvWorker``: the worker-side half of pykv (vLLM's ``OffloadingWorker``).

A translator between vLLM's transfer jobs and a ``pykv.store.BlockStore``: a job's
GPU blocks are cut into storage-block chunks (``blocks_per_chunk`` GPU blocks each,
the first one possibly partial on loads), each chunk becomes a ``BlockRef`` for the
store, and the store's copy requests become ``CopyTask``s for the copier (torch, or
CUDA streams). How a job ends comes back as a ``JobEnd``, which this module turns
into vLLM's ``TransferResult``, the GPU blocks to recompute, and a ``WorkerReport``
for the scheduler.

Expedited loads (vLLM 0.33 ``submit_load(..., expedited=True)``, waited on within the
step) go ahead of all other store work.

Failure semantics (vLLM asserts ``TransferResult.success`` in every version):
every job is reported with ``success=True``; a load's failed chunk and every
later chunk of the job go to ``get_block_ids_with_load_errors`` (vLLM then
recomputes from the first bad block, with ``kv_load_failure_policy="recompute"``),
in the same step ``get_finished`` returns the job. The store quarantines corrupt
files and pauses stores the medium refuses; failed keys and store failures go to
the scheduler in a ``WorkerReport`` (``take_report``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from pykv.counters import CounterFile, WorkerCounter
from pykv.connector.amx import request_amx_permission
from pykv.gil import apply_switch_interval
from pykv.jobledger import JobEnd, Kind, Release
from pykv.store import BlockRef, BlockStore, CopyDone, EngineShape, SlotCopy

from pykv.connector import compat
from pykv.connector.compat import CanonicalKVCaches, GPULoadStoreSpec, OffloadingConfig, OffloadingWorker, TransferResult
from pykv.config import PykvConfig
from pykv.connector.copier import CudaCopier, TorchCopier, cuda_host_register, cuda_host_unregister
from pykv.connector.codecs import codec_stage_for, device_codec_for, engine_codec, where_decoded
from pykv.connector.slot_copies import SlotCopies
from pykv.connector.layout import BlockLayout, namespace_for, slot_bytes, slot_counts
from pykv.connector.messages import NO_SLOT, PykvLoadSpec, PykvStoreSpec, WorkerReport

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05
"""With ``PYKV_STATS_FILE``: how stale the progress counters of running jobs may get in the file."""


@dataclass
class _Chunk:
    """One storage block of a vLLM job: the GPU blocks it covers. It is the block's copy target
    (``BlockRef.target``): the store hands it back in each ``SlotCopy``, so a copy needs no lookup."""

    group: int
    gpu_ids: np.ndarray
    skip: int  # leading sub-blocks of the chunk not covered by gpu_ids (a load after a GPU prefix hit)
    key: bytes
    dram_slot: int | None = None
    resident: bool = False
    ready: object = None  # the copier's marker: device work queued before the job (CUDA event)


class PykvWorker(OffloadingWorker):
    """Runs in each worker process; all vLLM calls come from the model runner thread."""

    def __init__(self, config: OffloadingConfig, pykv: PykvConfig, kv_caches: CanonicalKVCaches) -> None:
        self.config, self.pykv = config, pykv
        apply_switch_interval(pykv.gil_switch_ms)
        self.rank = config.parallel.rank
        self.layout = BlockLayout.from_kv_caches(kv_caches, config)
        tensors = [t.tensor for t in kv_caches.tensors]
        transient, dram = slot_counts(pykv, config)
        cuda = tensors[0].is_cuda
        if not cuda:
            request_amx_permission()  # before vLLM's AMX attention kernel runs in this process
        self._lock = threading.Lock()
        self._job_ended = threading.Condition(self._lock)  # notified whenever _finished grows
        self._jobs: dict[int, list[_Chunk]] = {}  # open jobs: their chunks, for the failed blocks at the end
        self._open_loads: set[int] = set()  # the load jobs among them
        self._finished: list[tuple[TransferResult, list[int], WorkerReport]] = []
        self._load_ended: dict[int, float] = {}  # id() of load results in _finished: when they ended
        self._failed_blocks: set[int] = set()
        self._failed_jobs: set[int] = set()
        self._report = WorkerReport()
        self._stats_file = CounterFile(f"worker{self.rank}")
        self._stats_lock = threading.Lock()
        self._stats_in_flight, self._stats_due = -1, 0.0  # jobs at the last counter write, and the next one's time
        self.early_release = True  # whatever the world size: the scheduler counts every rank's write ends
        codec = engine_codec(pykv, compat.kv_cache_dtype(config))
        shape = EngineShape(namespace_for(config, rank=self.rank, codec=codec.params), slot_bytes(config), transient,
                            dram, self.rank, self.early_release, codec=codec.params)
        register, unregister = (cuda_host_register, cuda_host_unregister) if cuda else (None, None)
        self.store = BlockStore(pykv, shape, self, register=register, unregister=unregister)
        self.namespace, self.devices, self.pool, self.reactor = (self.store.namespace, self.store.devices,
                                                              self.store.pool, self.store.reactor)
        self.counters: Counter[str] = self.store.counters
        self.copier = CudaCopier(tensors, self.layout) if cuda else TorchCopier(tensors, self.layout)
        self.device_codec = device_codec_for(codec, pykv, self.copier, [
            self.layout.geometry(g).payload_length for g in range(len(self.layout.groups))])
        self.codec_stage = codec_stage_for(codec, self.device_codec, pykv, shape.slot_bytes, register, unregister)
        self.slots = SlotCopies(self.pool, self.copier, self.device_codec, self.codec_stage)
        log.info("pykv worker %d: namespace %s, %d staging + %d DRAM slots of %d bytes, %s I/O, %s copies, codec %s%s",
                 self.rank, self.namespace.id, transient, dram, self.pool.slot_bytes, self.reactor.backend.name,
                 type(self.copier).__name__, codec.params, where_decoded(codec, self.device_codec))

    @property
    def dram_base(self) -> int:
        """The pool slot of DRAM-tier slot 0."""
        return self.store.dram_base

    # -- vLLM API ------------------------------------------------------------------------------
    def submit_load(self, job_id: int, src_spec: PykvLoadSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        self.counters[WorkerCounter.LOAD_SUBMITTED_NS] = time.time_ns()
        try:
            chunks = self._chunks(dst_spec, src_spec.keys, src_spec.dram_slots, src_spec.resident, store=False)
        except ValueError as exc:
            log.error("pykv: load job %d: %s", job_id, exc)
            self._finish_now(job_id, load_failed_ids=[int(i) for i in compat.block_ids(dst_spec)],
                             failed_keys=list(src_spec.keys))
            return True
        self._open(job_id, chunks, load=True)
        self.store.load_blocks(job_id, [self._ref(c, g) for c, g in self._geometries(chunks)],
                               owner=getattr(src_spec, "req_id", None), urgent=expedited)
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: PykvStoreSpec) -> bool:
        try:
            chunks = self._chunks(src_spec, dst_spec.keys, dst_spec.dram_slots, (), store=True)
        except ValueError as exc:
            log.error("pykv: store job %d: %s", job_id, exc)
            self._refuse_store(job_id, dst_spec)
            return True
        self._open(job_id, chunks)
        if not self.store.store_blocks(job_id, [self._ref(c, g) for c, g in self._geometries(chunks)]):
            with self._lock:
                del self._jobs[job_id]
            self._refuse_store(job_id, dst_spec)  # stores are paused
        return True

    # -- preloads (the connector hands them over from the scheduler's metadata) ----------------
    def submit_preloads(self, plans: dict[str, tuple[bytes, ...]]) -> None:
        """Read these blocks ahead for requests still waiting (req_id -> keys, in order).

        Speculative: the reactor runs them after demand work, within its slot bounds; a
        block wanted by several requests is read once. The request's load claims them.
        """
        for req_id, keys in plans.items():
            self.store.preload_blocks(req_id, keys)

    def release_preloads(self, req_ids) -> None:
        """These requests left the waiting queue: blocks only they wanted free their slots."""
        for req_id in req_ids:
            self.store.release_preloads(req_id)

    def get_finished(self) -> list[TransferResult]:
        """Jobs done since the last call; their failures become reportable in this same step. Jobs without
        progress for ``io_deadline`` end here as failed (``BlockStore.check_stalls``)."""
        self.store.check_stalls()
        with self._lock:
            finished, self._finished = self._finished, []
            now = time.monotonic()
            for result, failed_ids, report in finished:
                ended = self._load_ended.pop(id(result), None)
                if ended is not None:
                    self.counters[WorkerCounter.LOAD_REPORT_WAIT_US] += int((now - ended) * 1e6)
                    self.counters[WorkerCounter.LOAD_REPORTED_NS] = time.time_ns()
                self._failed_blocks.update(failed_ids)
                if failed_ids:
                    self._failed_jobs.add(result.job_id)
                self._report = self._report.merge(report)
            in_flight = len(self._jobs)
        # vLLM calls this many times per step (and spins on it while loads run): the counters are
        # gathered only when jobs came or went, or every STATS_INTERVAL_S for the progress counters
        if finished or in_flight != self._stats_in_flight or time.monotonic() >= self._stats_due:
            self._write_stats()
        return [result for result, _, _ in finished]

    def wait_idle_step(self) -> None:
        """(An engine step that runs no model.) While this worker's loads run and none has ended
        unreported, wait up to ``idle_wait_ms`` for a job to end: vLLM's loop would otherwise go round
        at once, holding the GIL pykv's threads need to finish those loads."""
        timeout = self.pykv.idle_wait_ms / 1e3
        if timeout <= 0:
            return
        with self._lock:
            if self._finished or not self._open_loads:
                return
            began = time.perf_counter()
            self._job_ended.wait(timeout)
        self.counters[WorkerCounter.IDLE_WAITS] += 1
        self.counters[WorkerCounter.IDLE_WAIT_US] += int((time.perf_counter() - began) * 1e6)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of failed loads among the jobs returned by ``get_finished`` so far."""
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_failed_load_jobs(self) -> set[int]:
        """Load jobs with failures among those returned by ``get_finished`` so far."""
        with self._lock:
            jobs, self._failed_jobs = self._failed_jobs, set()
        return jobs

    def take_report(self) -> WorkerReport:
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return report

    def wait(self, job_ids: set[int]) -> None:
        """Block until vLLM may reuse these jobs' GPU blocks (it calls this before handing a block
        of an unfinished job to another request): a load's once it ends, a store's once every
        block is copied into a host slot, not when its files are written (see docs/architecture.md,
        "When a store lets go")."""
        began = time.perf_counter()
        self.store.wait_engine_blocks(list(job_ids))
        self.counters[WorkerCounter.FLUSH_WAITS] += 1
        self.counters[WorkerCounter.FLUSH_WAIT_US] += int((time.perf_counter() - began) * 1e6)

    def shutdown(self) -> None:
        self.store.stop_io()
        self.copier.close()
        if self.device_codec is not None:
            self.device_codec.close()
        self.slots.close()
        if self.codec_stage is not None:
            self.codec_stage.close()
        self.store.close()
        self._write_stats()
        self._stats_file.flush()

    # -- vLLM's blocks to pykv's ---------------------------------------------------------------
    def _chunks(self, spec: GPULoadStoreSpec, keys, slots, resident, *, store: bool) -> list[_Chunk]:
        """Cut the GPU spec into storage-block chunks matched with ``keys`` in order."""
        ids = compat.block_ids(spec)
        bpc = self.layout.blocks_per_chunk
        chunks: list[_Chunk] = []
        offset = 0
        for group, (size, first) in enumerate(zip(spec.group_sizes, spec.block_indices)):
            skip, position = first % bpc, 0
            while position < size:
                n = min(bpc - skip, size - position)
                if store and (skip or n != bpc):
                    raise ValueError(f"group {group}: store of a partial chunk ({n} blocks, skip {skip})")
                k = len(chunks)
                if k >= len(keys):
                    raise ValueError(f"{len(keys)} keys for more chunks than that")
                slot = slots[k] if k < len(slots) and slots[k] != NO_SLOT else None
                chunks.append(_Chunk(group, ids[offset + position:offset + position + n], skip, keys[k], slot,
                                     bool(resident[k]) if slot is not None and k < len(resident) else False))
                position += n
                skip = 0
            offset += size
        if len(chunks) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(chunks)} chunks")
        return chunks

    def _geometries(self, chunks: list[_Chunk]):
        return ((c, self.layout.geometry(c.group)) for c in chunks)

    @staticmethod
    def _ref(chunk: _Chunk, geometry) -> BlockRef:
        return BlockRef(chunk.key, geometry, chunk.dram_slot, chunk.resident, target=chunk)

    def _open(self, job_id: int, chunks: list[_Chunk], *, load: bool = False) -> None:
        ready = self.copier.mark_submitted()
        for chunk in chunks:
            chunk.ready = ready
        with self._lock:
            self._jobs[job_id] = chunks
            if load:
                self._open_loads.add(job_id)

    def _refuse_store(self, job_id: int, spec: PykvStoreSpec) -> None:
        """A store this worker does not run: every block failed, and this rank is done with their
        DRAM slots (the scheduler frees a slot once every rank is)."""
        ended = [(k, self.rank) for k, slot in zip(spec.keys, spec.dram_slots) if slot != NO_SLOT]
        self._finish_now(job_id, failed_stores=[(k, False) for k in spec.keys],
                         stores_ended=ended if self.early_release else [])

    def _finish_now(self, job_id: int, *, load_failed_ids: list[int] = (), failed_keys: list[bytes] = (),
                    failed_stores: list[tuple[bytes, bool]] = (),
                    stores_ended: list[tuple[bytes, int]] = ()) -> None:
        report = WorkerReport()
        report.failed_loads, report.failed_stores = list(failed_keys), list(failed_stores)
        report.stores_ended = list(stores_ended)
        with self._lock:
            self._post((TransferResult(job_id, True, 0, 0.0), list(load_failed_ids), report))

    def _post(self, entry: tuple[TransferResult, list[int], WorkerReport]) -> None:
        """(Under ``_lock``.) A job vLLM may now collect; wakes an idle step's wait."""
        self._finished.append(entry)
        self._job_ended.notify_all()

    # -- the store's client (reactor, copier or engine thread) ---------------------------------------
    def to_slots(self, copies: list[SlotCopy], done: CopyDone) -> None:
        self.slots.to_slots(copies, done)

    def from_slots(self, copies: list[SlotCopy], done: CopyDone) -> None:
        self.slots.from_slots(copies, done)

    def store_released(self, release: Release) -> None:
        """A store sealed in its DRAM slots: vLLM gets it now, the writes go on (early release); or one
        given up after io_deadline, whose unfilled blocks are reported unstored in the same step."""
        report = WorkerReport()
        report.failed_stores = [(key, False) for key in release.unstored]
        report.stores_ended = [(key, self.rank) for key in release.slots_done]
        with self._lock:
            self._post((TransferResult(release.job, True, release.bytes, release.seconds), [], report))

    def job_ended(self, end: JobEnd) -> None:
        report, failed_ids = WorkerReport(), []
        with self._lock:
            chunks = self._jobs.pop(end.job)
            self._open_loads.discard(end.job)
        if end.kind is Kind.LOAD:
            if end.failures:
                failed_ids = [int(b) for c in chunks[end.first_failed:] for b in c.gpu_ids]
                report.failed_loads = end.failed_keys
        else:
            report.failed_stores = [(end.keys[i], dram_ok) for i, dram_ok in end.failed_stores]
            report.store_error = end.pause
            report.stores_ended = [(end.keys[i], self.rank) for i in end.stores_ended]
        with self._lock:
            if end.released:  # vLLM has this job already: only the report is left to send
                self._report = self._report.merge(report)
            else:
                result = TransferResult(end.job, True, end.bytes, end.seconds)
                self._post((result, failed_ids, report))
                if end.kind is Kind.LOAD:
                    self._load_ended[id(result)] = time.monotonic()
                    self.counters[WorkerCounter.LOAD_ENDED_NS] = time.time_ns()
        if end.released:
            # An idle engine stops calling get_finished once it has every job, so the end of these
            # writes is written out here (calibrate's settle step waits for it).
            self._write_stats()

    def _write_stats(self) -> None:
        """(Engine or reactor thread.) Dump the counters when ``PYKV_STATS_FILE`` asks for it."""
        if not self._stats_file.enabled:
            return
        with self._stats_lock:
            with self._lock:
                in_flight = len(self._jobs) + len(self._finished)
                self._stats_in_flight = len(self._jobs)
            self._stats_due = time.monotonic() + STATS_INTERVAL_S
            self._stats_file.write({**self.store.stats(), **getattr(self.copier, "stats", {}),
                                    **getattr(self.device_codec, "stats", {}),
                                    WorkerCounter.JOBS_IN_FLIGHT: in_flight})
