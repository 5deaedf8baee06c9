"""``PykvWorker``: the worker-side half of pykv (vLLM's ``OffloadingWorker``).

Translates vLLM's transfer jobs into plain pykv blocks for the ``Reactor``: a
job's GPU blocks are cut into storage-block chunks (``blocks_per_chunk`` GPU
blocks each, the first one possibly partial on loads), each chunk becomes a
``LoadBlock``/``StoreBlock`` with its file path, and the reactor's ``fill`` /
``deliver`` callbacks hand slots to the copier.

Expedited loads (vLLM 0.33 ``submit_load(..., expedited=True)``, waited on within the
step) go ahead of all other reactor work (``Reactor.submit_load(urgent=True)``).

Failure semantics (vLLM asserts ``TransferResult.success`` in every version):
every job is reported with ``success=True``; a load's failed chunk and every
later chunk of the job go to ``get_block_ids_with_load_errors`` (vLLM then
recomputes from the first bad block, with ``kv_load_failure_policy="recompute"``),
in the same step ``get_finished`` returns the job. Corrupt or truncated files are
moved to ``<root>/.pykv/quarantine/`` so later lookups miss. Failed keys and store
failures go to the scheduler in a ``WorkerReport`` (``take_report``). A disk-level
store failure (disk full, read-only tree) pauses this worker's stores for a while
with one warning per pause; serving goes on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from pykv.errors import FormatError
from pykv.failures import BlockFailure, Step
from pykv.media import PosixMedium
from pykv.io.probe import direct_io_supported, open_backend
from pykv.policy import Kind
from pykv.reactor import (FillRequest, JobResult, LoadBlock, Reactor, ReactorConfig, ReadyBlock, StoreBlock,
                          backend_depth, slot_header)
from pykv.staging import StagingPool
from pykv.tree import KVTree, TreeOptions

from pykv.connector import compat
from pykv.connector.compat import CanonicalKVCaches, GPULoadStoreSpec, OffloadingConfig, OffloadingWorker, TransferResult
from pykv.config import PykvConfig
from pykv.connector.copier import CopyTask, CudaCopier, TorchCopier, cuda_host_register, cuda_host_unregister
from pykv.connector.layout import BlockLayout, early_release_enabled, namespace_for, slot_bytes, slot_counts
from pykv.connector.spec import NO_SLOT, PykvLoadSpec, PykvStoreSpec, WorkerReport
from pykv.counters import CounterFile

log = logging.getLogger(__name__)


def _reactor_takes_slots() -> bool:
    return "slot" in LoadBlock.__dataclass_fields__


@dataclass
class _Chunk:
    group: int
    gpu_ids: np.ndarray
    skip: int
    key: bytes
    slot: int | None = None  # pool slot (DRAM tier) or None
    resident: bool = False


@dataclass
class _Job:
    job_id: object  # vLLM's job id, or (part, vLLM's job id) for a part of a split load
    is_load: bool
    chunks: list[_Chunk]
    started: float = field(default_factory=time.monotonic)
    copy_failed: set[int] = field(default_factory=set)
    ready: object = None  # the copier's marker: device work queued before the job (CUDA event)
    parent: "_Job | None" = None  # a part: the job it belongs to, and its chunks' indices there
    indices: list[int] = field(default_factory=list)
    parts: int = 0  # a split job: parts not finished yet, and their results merged so far
    merged: JobResult | None = None
    unfilled: set[int] = field(default_factory=set)  # a store's chunks not yet copied out of the GPU
    filled_bytes: int = 0
    staged: int = 0  # a store's blocks whole (payload and header) in their slots
    released: bool = False  # a store already reported to vLLM (early release); its writes go on

    def holds_gpu_blocks(self) -> bool:
        """Whether vLLM must not reuse this job's GPU blocks yet: a load until it ends, a store
        until every chunk sits in a host slot (its disk write may still be running)."""
        return self.is_load or bool(self.unfilled)


class PykvWorker(OffloadingWorker):
    """Runs in each worker process; all vLLM calls come from the model runner thread."""

    def __init__(self, config: OffloadingConfig, pykv: PykvConfig, kv_caches: CanonicalKVCaches) -> None:
        self.config, self.pykv = config, pykv
        self.rank = config.parallel.rank
        self.namespace = namespace_for(config, rank=self.rank)
        self.tree = KVTree.create(pykv.root, TreeOptions(pykv.file_mode, pykv.dir_mode, pykv.fsync))
        self.counters: Counter[str] = Counter()
        self._store_pause_until = 0.0
        try:
            self.tree.ensure_namespace(self.namespace)
        except OSError as exc:
            self._pause_stores(f"namespace directory: {exc.strerror}")
        self.layout = BlockLayout.from_kv_caches(kv_caches, config)
        tensors = [t.tensor for t in kv_caches.tensors]
        transient, dram = slot_counts(pykv, config)
        if dram and not _reactor_takes_slots():
            log.warning("pykv: this pykv core cannot use DRAM-tier slots; DRAM tier off in worker %d", self.rank)
            dram = 0
        self.dram_slots, self.dram_base = dram, transient
        cuda = tensors[0].is_cuda
        self.pool = StagingPool(slot_bytes(config), transient + dram, reserved=dram,
                                register=cuda_host_register if cuda else None,
                                unregister=cuda_host_unregister if cuda else None)
        self._slot_tensors = [torch.frombuffer(self.pool.view(s), dtype=torch.int8) for s in range(self.pool.num_slots)]
        self.copier = CudaCopier(tensors, self.layout) if cuda else TorchCopier(tensors, self.layout)
        direct, why = direct_io_supported(pykv.root)
        if not direct:
            log.info("pykv: %s does not take O_DIRECT (%s); using buffered I/O", pykv.root, why)
        reactor_config = ReactorConfig(pykv.io_depth, pykv.open_ahead, pykv.verify,
                                       max_speculative=pykv.preload_max_bytes // self.pool.slot_bytes,
                                       read_segment=pykv.read_segment_bytes)
        backend = open_backend(pykv.io_engine, depth=backend_depth(reactor_config, self.pool.slot_bytes),
                               directory=pykv.root)
        self._lock = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._finished: list[tuple[TransferResult, list[int], WorkerReport]] = []
        self._failed_blocks: set[int] = set()
        self._failed_jobs: set[int] = set()
        self._report = WorkerReport()
        self._stats_file = CounterFile(f"worker{self.rank}")
        self._stats_lock = threading.Lock()
        self.early_release = early_release_enabled(config)
        self.reactor = Reactor(backend, self.pool, PosixMedium(self.tree, direct=direct),
                               config=reactor_config,
                               sink=self, source=self, on_job_done=self._on_job_done)
        log.info("pykv worker %d: namespace %s, %d staging + %d DRAM slots of %d bytes, %s I/O, %s copies",
                 self.rank, self.namespace.id, transient, dram, self.pool.slot_bytes, backend.name,
                 type(self.copier).__name__)

    # -- vLLM API ------------------------------------------------------------------------------
    def submit_load(self, job_id: int, src_spec: PykvLoadSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        try:
            chunks = self._chunks(dst_spec, src_spec.keys, src_spec.dram_slots, src_spec.resident, store=False)
        except ValueError as exc:
            log.error("pykv: load job %d: %s", job_id, exc)
            self._finish_now(job_id, load_failed_ids=[int(i) for i in compat.block_ids(dst_spec)],
                             failed_keys=list(src_spec.keys))
            return True
        job = _Job(job_id, True, chunks, ready=self.copier.mark_submitted())
        blocks = [LoadBlock(self.tree.block_path(self.namespace.id, c.key), self.namespace.fingerprint, c.key,
                            self.layout.geometry(c.group), **self._slot_args(c)) for c in chunks]
        self.counters["load_jobs"] += 1
        owner = getattr(src_spec, "req_id", None)
        resident = [i for i, c in enumerate(chunks) if c.resident]
        if expedited:
            self.counters["load_jobs_expedited"] += 1
        if not resident:
            self._start(job, blocks, owner=owner, urgent=expedited)
        elif len(resident) == len(chunks):
            self._load_resident(job, blocks)
        else:
            self._load_split(job, blocks, resident, owner, urgent=expedited)
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: PykvStoreSpec) -> bool:
        try:
            chunks = self._chunks(src_spec, dst_spec.keys, dst_spec.dram_slots, (), store=True)
        except ValueError as exc:
            log.error("pykv: store job %d: %s", job_id, exc)
            self._finish_now(job_id, failed_stores=[(k, False) for k in dst_spec.keys])
            return True
        if time.monotonic() < self._store_pause_until:
            self.counters["store_blocks_paused"] += len(chunks)
            self._finish_now(job_id, failed_stores=[(c.key, False) for c in chunks])
            return True
        job = _Job(job_id, False, chunks, ready=self.copier.mark_submitted(), unfilled=set(range(len(chunks))))
        blocks = [StoreBlock(self.tree.block_path(self.namespace.id, c.key), self.namespace.fingerprint, c.key,
                             self.layout.geometry(c.group), **({"slot": c.slot} if c.slot is not None else {}))
                  for c in chunks]
        self.counters["store_jobs"] += 1
        self._start(job, blocks)
        return True

    # -- preloads (the connector hands them over from the scheduler's metadata) ----------------
    def submit_preloads(self, plans: dict[str, tuple[bytes, ...]]) -> None:
        """Read these blocks ahead for requests still waiting (req_id -> keys, in order).

        Speculative: the reactor runs them after demand work, within its slot bounds; a
        block wanted by several requests is read once. The request's load claims them.
        """
        for req_id, keys in plans.items():
            blocks = [LoadBlock(self.tree.block_path(self.namespace.id, k), self.namespace.fingerprint, k)
                      for k in keys]
            self.counters["preload_blocks_planned"] += len(blocks)
            self.reactor.submit_preload(req_id, blocks)

    def release_preloads(self, req_ids) -> None:
        """These requests left the waiting queue: blocks only they wanted free their slots."""
        for req_id in req_ids:
            self.reactor.release_preloads(req_id)

    def get_finished(self) -> list[TransferResult]:
        """Jobs done since the last call; their failures become reportable in this same step."""
        with self._lock:
            finished, self._finished = self._finished, []
            for result, failed_ids, report in finished:
                self._failed_blocks.update(failed_ids)
                if failed_ids:
                    self._failed_jobs.add(result.job_id)
                self._report = self._report.merge(report)
        self._write_stats()
        return [result for result, _, _ in finished]

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
        of an unfinished job to another request). A store releases its blocks once they are copied
        into host slots, not when its files are written: waiting for the disk here stalled the
        engine for the whole write (H200 run 6: 1 s per 16k-token prompt with prefix caching off,
        whose freed blocks are reused at once)."""
        began = time.perf_counter()
        with self._lock:
            while any(job.holds_gpu_blocks() for j in job_ids if (job := self._jobs.get(j)) is not None):
                self._lock.wait(1.0)
        self.counters["flush_waits"] += 1
        self.counters["flush_wait_us"] += int((time.perf_counter() - began) * 1e6)

    def shutdown(self) -> None:
        self.reactor.close()
        self.copier.close()
        self._slot_tensors.clear()
        self.pool.close()
        self._write_stats()

    # -- job plumbing ----------------------------------------------------------------------------
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
                slot = slots[k] if k < len(slots) and slots[k] != NO_SLOT and slots[k] < self.dram_slots else None
                chunks.append(_Chunk(group, ids[offset + position:offset + position + n], skip, keys[k],
                                     None if slot is None else self.dram_base + slot,
                                     bool(resident[k]) if slot is not None and k < len(resident) else False))
                position += n
                skip = 0
            offset += size
        if len(chunks) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(chunks)} chunks")
        return chunks

    @staticmethod
    def _slot_args(chunk: _Chunk) -> dict:
        return {} if chunk.slot is None else {"slot": chunk.slot}

    def _start(self, job: _Job, blocks: list, owner: str | None = None, urgent: bool = False) -> None:
        with self._lock:
            self._jobs[job.job_id] = job
        if job.is_load:
            self.reactor.submit_load(job.job_id, blocks, owner=owner, urgent=urgent)
        else:
            self.reactor.submit_store(job.job_id, blocks)

    def _finish_now(self, job_id: int, *, load_failed_ids: list[int] = (), failed_keys: list[bytes] = (),
                    failed_stores: list[tuple[bytes, bool]] = ()) -> None:
        report = WorkerReport()
        report.failed_loads, report.failed_stores = list(failed_keys), list(failed_stores)
        with self._lock:
            self._finished.append((TransferResult(job_id, True, 0, 0.0), list(load_failed_ids), report))
            self._lock.notify_all()

    # -- DRAM-tier loads (engine thread) ----------------------------------------------------------
    def _load_split(self, job: _Job, blocks: list[LoadBlock], resident: list[int], owner: str | None,
                    urgent: bool = False) -> None:
        """A load with blocks in the DRAM tier and blocks on disk: the DRAM part is copied at
        once (``_load_resident``), the disk part goes through the reactor; the job ends when
        both parts have (``_part_done``). Through the reactor, the DRAM blocks would wait for
        its delivery batches (H200 P40 run 5: 19.8 s of copy wall time against 3.8 s)."""
        in_dram = set(resident)
        on_disk = [i for i in range(len(job.chunks)) if i not in in_dram]
        job.parts, job.merged = 2, JobResult(job.job_id, Kind.LOAD, len(job.chunks))
        with self._lock:
            self._jobs[job.job_id] = job
        parts = {}
        for name, indices in (("dram", resident), ("disk", on_disk)):
            parts[name] = _Job((name, job.job_id), True, [job.chunks[i] for i in indices], job.started,
                               ready=job.ready, parent=job, indices=indices)
        self._load_resident(parts["dram"], [blocks[i] for i in resident])
        self._start(parts["disk"], [blocks[i] for i in on_disk], owner=owner, urgent=urgent)

    def _part_done(self, part: _Job, result: JobResult) -> None:
        """One part of a split load ended: fold it into its job; the last one ends the job."""
        job = part.parent
        with self._lock:
            del self._jobs[part.job_id]
            merged = job.merged
            merged.failed.update({part.indices[i]: reason for i, reason in result.failed.items()})
            job.copy_failed.update(part.indices[i] for i in part.copy_failed)
            merged.bytes += result.bytes
            merged.seconds = max(merged.seconds, result.seconds)
            job.parts -= 1
            last = job.parts == 0
        if last:
            self._on_job_done(merged)

    def _load_resident(self, job: _Job, blocks: list[LoadBlock]) -> None:
        """A load served wholly by the DRAM tier: no I/O, so it skips the reactor.

        Each slot's header is checked here and all blocks go to the copier as one batch
        (one batched copy on CUDA), like vLLM's CPU tier; the job ends when the copy does.
        Through the reactor, a DRAM hit paid thread hand-offs per delivery batch (each
        waiting for the GIL the busy engine thread holds) for no I/O at all. The slots are
        safe to read: the manager pinned these keys in ``prepare_load`` until ``complete_load``.
        """
        with self._lock:
            self._jobs[job.job_id] = job
        result = JobResult(job.job_id, Kind.LOAD, len(blocks))
        tasks, sizes = [], {}
        for index, (chunk, block) in enumerate(zip(job.chunks, blocks)):
            try:
                header = slot_header(self.pool, chunk.slot, block)
            except FormatError as exc:
                result.failed[index] = BlockFailure(Step.CHECK, detail=exc.reason)
                continue
            sizes[index] = header.file_size
            tasks.append(CopyTask(self._payload(chunk.slot, header.payload_length), chunk.group, chunk.gpu_ids,
                                  chunk.skip, token=index, after=job.ready))
        remaining = [len(tasks)]

        def copied(task: CopyTask, ok: bool) -> None:  # copier thread (CUDA) or this thread
            with self._lock:
                if not ok:
                    job.copy_failed.add(task.token)
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._finish_resident(job, result, sizes)

        if tasks:
            self.copier.from_slots(tasks, copied)
        else:
            self._finish_resident(job, result, sizes)

    def _finish_resident(self, job: _Job, result: JobResult, sizes: dict[int, int]) -> None:
        delivered = [size for index, size in sizes.items() if index not in job.copy_failed]
        result.bytes, result.seconds = sum(delivered), time.monotonic() - job.started
        self.counters["dram_delivered_blocks"] += len(delivered)
        self.counters["dram_delivered_bytes"] += result.bytes
        self._on_job_done(result)

    # -- reactor callbacks (reactor thread) -------------------------------------------------------
    def _payload(self, slot: int, length: int) -> torch.Tensor:
        from pykv.format import HEADER_SIZE
        return self._slot_tensors[slot][HEADER_SIZE:HEADER_SIZE + length]

    def fill(self, requests: list[FillRequest]) -> None:
        for r in requests:
            chunk = self._jobs[r.job].chunks[r.index]
            task = CopyTask(self._payload(r.slot, r.length), chunk.group, chunk.gpu_ids, 0, token=r,
                            after=self._jobs[r.job].ready)
            self.copier.to_slots([task], self._filled)

    def _filled(self, task: CopyTask, ok: bool) -> None:
        request: FillRequest = task.token
        with self._lock:
            job = self._jobs[request.job]
            if not ok:
                job.copy_failed.add(request.index)
            job.unfilled.discard(request.index)
            job.filled_bytes += request.length
            if not job.unfilled:
                self._lock.notify_all()
        self.reactor.filled(request.transfer, ok)

    def staged(self, job_id: object, index: int) -> None:
        """(Reactor thread.) Block ``index`` of a store is whole in its slot, header included."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return
            job.staged += 1
            if job.staged == len(job.chunks):
                self._release_early(job)

    def _release_early(self, job: _Job) -> None:
        """(Lock held.) A store whose blocks all sit in their DRAM slots ends for vLLM now: the
        manager makes them DRAM hits and keeps the slots pinned until ``stores_ended``. A turn of
        a conversation that comes back while its files are still being written then hits DRAM
        (H200 run 6, stage R: 7 of 18 such requests missed everything while the writes ran)."""
        if (not self.early_release or job.is_load or job.released or job.copy_failed
                or any(c.slot is None for c in job.chunks)):
            return
        job.released = True
        self.counters["store_jobs_released_early"] += 1
        self._finished.append((TransferResult(job.job_id, True, job.filled_bytes, time.monotonic() - job.started),
                               [], WorkerReport()))

    def deliver(self, blocks: list[ReadyBlock]) -> None:
        tasks = []
        for b in blocks:
            chunk = self._jobs[b.job].chunks[b.index]
            tasks.append(CopyTask(self._payload(b.slot, b.header.payload_length), chunk.group, chunk.gpu_ids,
                                  chunk.skip, token=b, after=self._jobs[b.job].ready))
        self.copier.from_slots(tasks, self._delivered)

    def _delivered(self, task: CopyTask, ok: bool) -> None:
        block: ReadyBlock = task.token
        if not ok:
            self._jobs[block.job].copy_failed.add(block.index)
        self.reactor.consumed(block.transfer)

    def _on_job_done(self, result: JobResult) -> None:
        with self._lock:
            job = self._jobs[result.job]
        if job.parent is not None:
            self._part_done(job, result)
            return
        report, failed_ids = WorkerReport(), []
        if job.is_load:
            failed = set(result.failed) | job.copy_failed
            for i, chunk in enumerate(job.chunks):
                source = "dram" if chunk.resident else "disk"
                self.counters[f"load_blocks_{source}" if i not in failed else f"load_blocks_failed_{source}"] += 1
            if failed:
                first = min(failed)
                failed_ids = [int(b) for c in job.chunks[first:] for b in c.gpu_ids]
                report.failed_loads = [job.chunks[i].key for i in sorted(failed)]
                for i in sorted(failed):
                    self._quarantine_if_corrupt(job.chunks[i], result.failed.get(i, BlockFailure(Step.COPY)))
        else:
            self.counters["store_blocks"] += len(job.chunks)
            self.counters["store_published"] += result.published
            for i, failure in sorted(result.failed.items()):
                chunk = job.chunks[i]
                report.failed_stores.append((chunk.key, chunk.slot is not None and i not in job.copy_failed))
                self.counters["store_blocks_failed"] += 1
                if failure.medium_refuses_stores:
                    report.store_error = str(failure)
            if report.store_error:
                self._pause_stores(report.store_error)
            if self.early_release:
                report.stores_ended = [c.key for c in job.chunks if c.slot is not None]
        with self._lock:
            del self._jobs[job.job_id]
            if job.released:  # vLLM has this job already: only the report is left to send
                self._report = self._report.merge(report)
            else:
                self._finished.append((TransferResult(job.job_id, True, result.bytes, result.seconds), failed_ids,
                                       report))
            self._lock.notify_all()
        if job.released:
            # An idle engine stops calling get_finished once it has every job, so the end of these
            # writes is written out here (calibrate's settle step waits for it: H200 run 7).
            self._write_stats()

    # -- failures --------------------------------------------------------------------------------
    def _quarantine_if_corrupt(self, chunk: _Chunk, failure: BlockFailure) -> None:
        if chunk.resident or not failure.corrupt:
            return
        path = self.tree.block_path(self.namespace.id, chunk.key)
        try:
            target = self.tree.quarantine(path, f"load-{socket.gethostname()}-{os.getpid()}")
            log.warning("pykv: %s: %s; moved to %s", path, failure, target)
        except FileNotFoundError:
            return
        except OSError as exc:  # e.g. a planted link at .pykv: never fall back to deleting what may not be ours
            log.warning("pykv: %s: %s; left in place, quarantine failed (%s); `pykv fsck` reports it", path,
                        failure, exc.strerror or exc)
            return
        self.counters["quarantined"] += 1

    def _pause_stores(self, reason: str) -> None:
        now = time.monotonic()
        if now >= self._store_pause_until:
            log.warning("pykv worker %d: stores to %s failing (%s); pausing stores for %.0f s, serving continues",
                        self.rank, self.pykv.root, reason, self.pykv.store_retry_interval)
            self.counters["store_pauses"] += 1
        self._store_pause_until = now + self.pykv.store_retry_interval

    def _write_stats(self) -> None:
        """(Engine or reactor thread.) Dump the counters when ``PYKV_STATS_FILE`` asks for it."""
        if not self._stats_file.enabled:
            return
        with self._stats_lock:
            with self._lock:
                in_flight = len(self._jobs) + len(self._finished)
            stats = {**self.counters, **self.reactor.stats, **getattr(self.copier, "stats", {}),
                     "jobs_in_flight": in_flight}
            for key in ("delivered_blocks", "delivered_bytes"):  # the reactor's and the DRAM fast path's
                stats[key] += self.counters[f"dram_{key}"]
            self._stats_file.write(stats)
