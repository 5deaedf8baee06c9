"""Codecs on the KV cache's own device: the machinery (``DeviceCodec``) and ``fp8`` (``DeviceFp8``).

``fp8``: a store gathers the block's pages into a payload on the device, quantizes it there and
copies the scales and codes (about half the bytes) into the staging slot; a load copies the
stored bytes to the device, dequantizes them into the payload and scatters its pages into the KV
cache blocks with indexing kernels (``scatter``). ``planes-zstd`` decodes loads on the GPU the
same way (``device_zstd``). A load never changes the slot, so a DRAM-tier slot serves every later hit.

On CUDA one thread issues the work on one stream, in order, one step at a time: a store, or
up to ``step_blocks`` loads of one length that are queued at that moment (one copy call, one
decode and one scatter for them all), so the device scratch (``step_blocks`` payloads and
stored blocks, bounded by ``STEP_BYTES``) is reused in stream order and nothing waits for the
device while issuing; a poller thread waits for each step's event, then reads each block's
bad-input flag, a page-locked byte the device wrote: NaN or infinite KV fails a store, bytes
the encoder never writes fail a load (``Step.CHECK``: a miss, recomputed and quarantined), as
does a ``CodecError`` found on the host before any device work. A step that raises is issued
again block by block, so only the guilty block fails. On the CPU platform the same steps run on
one thread of their own (never on the reactor's thread).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from pykv.codec.base import CodecError
from pykv.codec.fp8 import Fp8Codec, decode_rows, quantize
from pykv.config_values import MAX_STEP_BLOCKS
from pykv.errors import InputError
from pykv.failures import BlockFailure, Step

from pykv.connector.copier import CopyTask, TorchCopier
from pykv.connector.scatter import RowScatter
from pykv.connector.step_graphs import GraphBackend, StepGraphs

log = logging.getLogger(__name__)

StoreDone = Callable[[CopyTask, bool, "int | None"], None]
"""``done(task, ok, stored)``: ``stored`` bytes of the coded payload at the start of the slot's payload."""
LoadDone = Callable[[CopyTask, bool, "BlockFailure | None"], None]
FLAGS = 64
"""Steps in flight on the device at most (each holds a row of page-locked flag bytes until it is read)."""
STEP_BYTES = 256 << 20
"""Raw payload bytes one load step decodes at most (``DeviceCodec.step_blocks``): the scratch on
the KV's device is this much payload plus its stored bytes."""
_NOTHING = object()
Issued = tuple[torch.Tensor, "int | None", object]
"""What a store's device work left: its bad-input flag, its stored length, what must live until
the stream passes it."""


@dataclass
class CodedLoad:
    """A load of a coded block: ``task.payload`` is the slot's stored bytes, written by codec
    ``params``, which decode to ``raw_length`` bytes."""

    task: CopyTask
    raw_length: int
    params: str


@dataclass
class _Work:
    store: bool
    item: CopyTask | CodedLoad
    done: Callable
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def task(self) -> CopyTask:
        return self.item if self.store else self.item.task


class DeviceCodec:
    """Runs one codec's block work on the device of ``copier``'s KV tensors. Subclasses give
    ``_encode`` (stores; a decode-only codec leaves stores to the codec threads), ``_decode_step``
    and ``_refusal``; ``payload`` is the device scratch of ``step_blocks`` of the largest raw payload."""

    name = "codec"
    encodes = True  # False: stores are encoded on the codec threads, only loads come here
    host_layer = False  # True: the codec threads code a store's stored bytes once more (``CodecStage.recode``)
    host_frames = False  # True: loads arrive with that layer decoded by the codec threads (``unlayered``)
    step_bytes = STEP_BYTES

    def __init__(self, params: str, copier: TorchCopier, largest_payload: int, *, streams: bool | None = None,
                 step_blocks: int | None = None) -> None:
        self.params, self.copier = params, copier
        self.device = copier.tensors[0].device
        self.largest = largest_payload
        self.step_blocks = step_blocks or max(1, min(MAX_STEP_BLOCKS, self.step_bytes // max(largest_payload, 1)))
        self.payload = torch.empty(largest_payload * self.step_blocks, dtype=torch.int8, device=self.device)
        self.scatter = RowScatter(copier.tensors, copier.layout, self.payload)
        self.cuda = self.device.type == "cuda" if streams is None else streams  # (tests: fake streams on the CPU)
        self._held = _NOTHING  # a work taken from the queue that does not fit the step being built
        self.stats: Counter[str] = Counter()  # codec_* (pykv.counters.WorkerCounter), CUDA only
        if not self.cuda:  # the CPU platform: one thread does each block's work in turn (never the reactor's)
            self._queued = queue.Queue()
            self._threads = [threading.Thread(target=self._run_queued, name=f"pykv-{self.name}-cpu", daemon=True)]
            self._threads[0].start()
        else:
            self._stream = torch.cuda.Stream(device=self.device)
            self._flags = torch.zeros((FLAGS, self.step_blocks), dtype=torch.bool,
                                      pin_memory=self.device.type == "cuda")
            self._free_flags = threading.Semaphore(FLAGS)
            self._next_flag = 0
            self._queued: queue.Queue = queue.Queue()
            self._pending: queue.Queue = queue.Queue()
            self._threads = [threading.Thread(target=target, name=f"pykv-{self.name}-{role}", daemon=True)
                             for role, target in (("issue", self._issue_queued), ("events", self._poll))]
            for thread in self._threads:
                thread.start()

    # -- the worker's calls ------------------------------------------------------------------------
    def store(self, tasks: Sequence[CopyTask], done: StoreDone) -> None:
        """Each task's KV encoded into its slot; ``done(task, ok, stored)`` once per task."""
        for task in tasks:
            self._submit(_Work(True, task, done))

    def load(self, loads: Sequence[CodedLoad], done: LoadDone) -> None:
        """Each coded block decoded into its KV blocks; ``done(task, ok, failure)`` once per load."""
        for load in loads:
            refused = self._refusal(load)
            if refused is not None:
                done(load.task, False, BlockFailure(Step.CHECK, detail=refused))
            else:
                self._submit(_Work(False, load, done))

    def close(self, timeout: float = 10.0) -> None:
        self._queued.put(None)
        for thread in self._threads:
            thread.join(timeout)

    # -- a codec's steps ---------------------------------------------------------------------------
    def _refusal(self, load: CodedLoad) -> str | None:
        """Why this load cannot be one of ours (checked before any device work), or None."""
        return self.raw_refusal(load.params, load.raw_length)

    def raw_refusal(self, params: str, raw_length: int) -> str | None:
        """Why a block of codec ``params`` and ``raw_length`` raw bytes (its trusted header's)
        cannot be one of ours, or None."""
        if params != self.params:
            return f"a block of codec {params[:80]}, this engine's is {self.params}"
        if not 0 < raw_length <= self.largest:
            return f"a coded block of {raw_length} raw bytes"
        return None

    def _encode(self, task: CopyTask) -> Issued:
        raise NotImplementedError(f"{self.name} encodes on the codec threads")

    def _decode_step(self, loads: Sequence[CodedLoad]) -> tuple[torch.Tensor, object]:
        """Several loads of one raw length at once: (one bad-input flag per load, what must live
        until the stream passes it)."""
        raise NotImplementedError

    def _into_kv_rows(self, loads: Sequence[CodedLoad]) -> object:
        """Row i of the scratch payload (the decoded payload of ``loads[i]``, all of one length)
        into that load's KV blocks, after the decode in stream order: one indexing kernel per KV
        tensor for them all (``scatter.RowScatter``)."""
        return self.scatter.rows(loads[0].raw_length, [load.task for load in loads])

    # -- steps -------------------------------------------------------------------------------------
    def _take(self) -> list[_Work] | None:
        """The next step: a store, or the loads of one raw length queued now (``step_blocks`` at
        most); None once closed."""
        work, self._held = (self._queued.get() if self._held is _NOTHING else self._held), _NOTHING
        if work is None:
            return None
        step = [work]
        while not work.store and len(step) < self.step_blocks:
            try:
                later = self._queued.get_nowait()
            except queue.Empty:
                break
            if later is None or later.store or later.item.raw_length != work.item.raw_length:
                self._held = later
                break
            step.append(later)
        return step

    def _run(self, works: Sequence[_Work]) -> tuple[torch.Tensor, int | None, object]:
        """A step's device work: (one bad-input flag per work, a store's stored length, keep)."""
        if works[0].store:
            bad, stored, keep = self._encode(works[0].item)
            return bad.reshape(1), stored, keep
        bad, keep = self._decode_step([work.item for work in works])
        return bad, None, keep

    def _finish(self, work: _Work, bad: bool, stored: int | None) -> None:
        if not work.store:
            failure = BlockFailure(Step.CHECK, detail=f"{self.name}: stored bytes the encoder never writes")
            work.done(work.task, not bad, failure if bad else None)
        elif bad:
            log.warning("pykv: a block's KV holds NaN or infinite values, or values the codec cannot scale; not "
                        "stored (codec %s)", self.name)
            work.done(work.task, False, None)
        else:
            work.done(work.task, True, stored)

    def _fail(self, work: _Work, error: Exception) -> None:
        if isinstance(error, CodecError) and not work.store:
            work.done(work.task, False, BlockFailure(Step.CHECK, detail=str(error)))
            return
        log.error("pykv: %s %s on the device failed: %s", self.name, "encoding" if work.store else "decoding",
                  error, exc_info=error)
        if work.store:
            work.done(work.task, False, None)
        else:
            work.done(work.task, False, BlockFailure(Step.COPY, detail=f"{self.name} decoding on the device failed"))

    def _step_raised(self, works: Sequence[_Work], error: Exception, again: Callable[[list[_Work]], None]) -> None:
        """A step that raised: its blocks ``again`` one by one, so only the guilty one fails; a
        single block's failure ends it."""
        if len(works) > 1:
            for work in works:
                again([work])
        else:
            self._fail(works[0], error)

    def _submit(self, work: _Work) -> None:
        self._queued.put(work)

    def _run_queued(self) -> None:
        """The CPU platform's thread: each step's work, then its blocks' ends."""
        while True:
            works = self._take()
            if works is None:
                return
            self._run_now(works)

    def _run_now(self, works: Sequence[_Work]) -> None:
        try:
            bad, stored, _ = self._run(works)
            flags = bad.tolist()
        except Exception as error:  # noqa: BLE001 - a failed block, not a failed engine
            self._step_raised(works, error, self._run_now)
            return
        for work, flag in zip(works, flags):
            self._finish(work, flag, stored)

    # -- CUDA --------------------------------------------------------------------------------------
    def _issue_queued(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            works = self._take()
            if works is None:
                self._pending.put(None)
                return
            self._issue(works)

    def _issue(self, works: Sequence[_Work]) -> None:
        """One step on the stream after what its blocks wait for; its events and flag row to the poller."""
        self._free_flags.acquire()
        index, self._next_flag = self._next_flag, (self._next_flag + 1) % FLAGS
        issuing = time.perf_counter()
        try:
            afters = {id(w.task.after): w.task.after for w in works if w.task.after is not None}
            for event in afters.values():
                self._stream.wait_event(event)
            if any(w.task.after is None for w in works):
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                began = torch.cuda.Event(enable_timing=True)
                began.record(self._stream)
                bad, stored, keep = self._run(works)
                self._flags[index, :len(works)].copy_(bad, non_blocking=True)
                event = torch.cuda.Event(enable_timing=True)
                event.record(self._stream)
        except Exception as error:  # noqa: BLE001
            self._free_flags.release()
            self._step_raised(works, error, self._issue)
            return
        self._count_issue(works, issuing)
        self._pending.put((works, index, stored, (began, event, issuing), keep))

    def _count_issue(self, works: Sequence[_Work], issuing: float) -> None:
        stats = self.stats
        stats["codec_steps"] += 1
        if not works[0].store:
            stats["codec_load_steps"] += 1
            stats["codec_loads"] += len(works)
        stats["codec_queued_us"] += int(sum(issuing - work.submitted for work in works) * 1e6)
        stats["codec_issue_us"] += int((time.perf_counter() - issuing) * 1e6)

    def _poll(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            works, index, stored, (began, event, issuing), _keep = item
            try:
                event.synchronize()
                flags = self._flags[index, :len(works)].tolist()
                self.stats["codec_gpu_us"] += int(began.elapsed_time(event) * 1e3)
                self.stats["codec_wall_us"] += int((time.perf_counter() - issuing) * 1e6)
            except Exception as error:  # noqa: BLE001
                self._free_flags.release()
                for work in works:
                    self._fail(work, error)
                continue
            self._free_flags.release()
            for work, flag in zip(works, flags):
                self._finish(work, flag, stored)


def whole_groups_refusal(raw_length: int, group: int) -> str | None:
    """Why ``raw_length`` raw bytes are not whole groups of ``group`` bf16/fp16 values, or None."""
    return f"a coded block of {raw_length} raw bytes" if raw_length % (2 * group) else None


class DeviceFp8(DeviceCodec):
    """``fp8`` stores and loads on the KV's device; ``payload_lengths``: the raw payload length of
    each KV group's storage blocks (whole groups of the codec, else ``InputError`` at start)."""

    name = "fp8"

    def __init__(self, codec: Fp8Codec, copier: TorchCopier, payload_lengths: Sequence[int], *,
                 streams: bool | None = None, step_blocks: int | None = None, graphs: bool = False,
                 graph_backend: GraphBackend | None = None) -> None:
        largest = largest_fp8_payload(codec, payload_lengths)
        super().__init__(codec.params, copier, largest, streams=streams, step_blocks=step_blocks)
        self.codec = codec
        self._stored = torch.empty(codec.stored_length(largest) * self.step_blocks, dtype=torch.uint8,
                                   device=self.device)
        self.graphs = None  # steps of whole chunks replayed as CUDA graphs (``codec_graphs``), CUDA only
        if graphs and (self.device.type == "cuda" or graph_backend is not None):
            self.graphs = StepGraphs(self.device, self.step_blocks * copier.layout.blocks_per_chunk, rows=FLAGS,
                                     backend=graph_backend)

    def raw_refusal(self, params: str, raw_length: int) -> str | None:
        return super().raw_refusal(params, raw_length) or whole_groups_refusal(raw_length, self.codec.group)

    def _refusal(self, load: CodedLoad) -> str | None:
        refused = super()._refusal(load)
        if refused is None and load.task.payload.numel() != self.codec.stored_length(load.raw_length):
            return f"{load.task.payload.numel()} stored bytes for {load.raw_length} raw"
        return refused

    def _encode(self, task: CopyTask) -> Issued:
        return encode_fp8(self, self.codec, task)

    def _decode_step(self, loads: Sequence[CodedLoad]) -> tuple[torch.Tensor, object]:
        """The loads' stored bytes into rows of the stored scratch (one copy call), one dequantize
        over all rows, one scatter of the payload rows into the KV blocks."""
        count, raw = len(loads), loads[0].raw_length
        length = self.codec.stored_length(raw)
        rows = np.array([(row, 0, 0, row * length, length) for row in range(count)], dtype=np.int64)
        kept = self.copier.copy_ranges([load.task.payload for load in loads], (self._stored,), rows,
                                       source_in_order=False)
        stored = self._stored[:count * length].view(count, length)
        rows = self.payload[:count * raw].view(torch.uint8).view(count, raw)
        whole = self.scatter.whole_ids([load.task for load in loads]) if self.graphs is not None else None
        if whole is None:
            bad = decode_rows(stored, rows, self.codec)
            return bad, (self._into_kv_rows(loads), kept)
        group, ids = whole
        index = self.graphs.ids[:len(ids)].view(count, -1)

        def body() -> torch.Tensor:
            flags = decode_rows(stored, rows, self.codec)
            self.scatter.put_whole(count, raw, group, index)
            return flags
        bad, replayed = self.graphs.run((count, raw, group), ids, body)
        self.stats["codec_graph_steps"] += replayed
        self.stats["codec_graphs"] = self.graphs.captured
        return bad, kept


def largest_fp8_payload(codec: Fp8Codec, payload_lengths: Sequence[int]) -> int:
    """The largest of the engine's raw payloads; ``InputError`` (one line) unless each is whole
    groups of ``codec``."""
    for length in payload_lengths:
        if length % (2 * codec.group):
            raise InputError(f"codec fp8: a storage block of {length} bytes is not whole groups of "
                             f"{codec.group} values; use codec none or planes-zstd for this model")
    return max(payload_lengths, default=0)


def encode_fp8(device: DeviceCodec, codec: Fp8Codec, task: CopyTask) -> Issued:
    """A store's KV gathered into ``device``'s payload scratch, quantized there, and its scales and
    codes (``codec``'s stored bytes) copied to the start of the slot (``task.payload``)."""
    raw = device.payload[:task.payload.numel()]
    keep = device.copier.copy_device_payload(CopyTask(raw, task.group, task.gpu_ids, task.skip), to_slot=True)
    codes, scales, bad = quantize(raw.view(codec.torch_dtype), codec.group)
    head = scales.numel()  # one byte each
    slot = task.payload.view(torch.uint8)
    slot[:head].copy_(scales, non_blocking=device.cuda)
    slot[head:head + codes.numel()].copy_(codes, non_blocking=device.cuda)
    return bad, head + codes.numel(), (keep, codes, scales)
