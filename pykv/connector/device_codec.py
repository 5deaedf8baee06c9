"""Codecs on the KV cache's own device: the machinery (``DeviceCodec``) and ``fp8`` (``DeviceFp8``).

``fp8``: a store gathers the block's pages into a payload on the device, quantizes it there and
copies the scales and codes (about half the bytes) into the staging slot; a load copies the
stored bytes to the device, dequantizes them into the payload and copies its pages to the KV
cache blocks. ``planes-zstd`` decodes loads on the GPU the same way (``device_zstd``). A load
never changes the slot, so a DRAM-tier slot serves every later hit.

On CUDA one thread issues every block's work on one stream, in order, so the device scratch
(one payload, one stored block) is reused in stream order and nothing waits for the device
while issuing; a poller thread waits for each block's event, then reads the block's bad-input
flag, a page-locked byte the device wrote: NaN or infinite KV fails a store, bytes the encoder
never writes fail a load (``Step.CHECK``: a miss, recomputed and quarantined), as does a
``CodecError`` found on the host before any device work. On the CPU platform the same steps
run on one thread of their own, block after block (never on the reactor's thread).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pykv.codec.base import CodecError
from pykv.codec.fp8 import Fp8Codec, decode_tensor, quantize
from pykv.errors import InputError
from pykv.failures import BlockFailure, Step

from pykv.connector.copier import CopyTask, TorchCopier

log = logging.getLogger(__name__)

StoreDone = Callable[[CopyTask, bool, "int | None"], None]
"""``done(task, ok, stored)``: ``stored`` bytes of the coded payload at the start of the slot's payload."""
LoadDone = Callable[[CopyTask, bool, "BlockFailure | None"], None]
FLAGS = 64
"""Blocks in flight on the device at most (each holds one page-locked flag byte until it is read)."""
Issued = tuple[torch.Tensor, "int | None", object]
"""What a block's device work left: its bad-input flag, a store's stored length, what must live
until the stream passes it."""


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

    @property
    def task(self) -> CopyTask:
        return self.item if self.store else self.item.task


class DeviceCodec:
    """Runs one codec's block work on the device of ``copier``'s KV tensors. Subclasses give
    ``_encode`` (stores; a decode-only codec leaves stores to the codec threads), ``_decode``
    and ``_refusal``; ``payload`` is the device scratch of the largest raw payload."""

    name = "codec"
    encodes = True  # False: stores are encoded on the codec threads, only loads come here

    def __init__(self, params: str, copier: TorchCopier, largest_payload: int, *, streams: bool | None = None) -> None:
        self.params, self.copier = params, copier
        self.device = copier.tensors[0].device
        self.payload = torch.empty(largest_payload, dtype=torch.int8, device=self.device)
        self.cuda = self.device.type == "cuda" if streams is None else streams  # (tests: fake streams on the CPU)
        if not self.cuda:  # the CPU platform: one thread does each block's work in turn (never the reactor's)
            self._queued = queue.Queue()
            self._threads = [threading.Thread(target=self._run_queued, name=f"pykv-{self.name}-cpu", daemon=True)]
            self._threads[0].start()
        else:
            self._stream = torch.cuda.Stream(device=self.device)
            self._flags = torch.zeros(FLAGS, dtype=torch.bool, pin_memory=self.device.type == "cuda")
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
        if load.params != self.params:
            return f"a block of codec {load.params}, this engine's is {self.params}"
        if not 0 < load.raw_length <= self.payload.numel():
            return f"a coded block of {load.raw_length} raw bytes"
        return None

    def _encode(self, task: CopyTask) -> Issued:
        raise NotImplementedError(f"{self.name} encodes on the codec threads")

    def _decode(self, load: CodedLoad) -> Issued:
        raise NotImplementedError

    def _into_kv(self, load: CodedLoad) -> object:
        """The decoded payload's pages into the load's KV blocks (after the decode, in stream order)."""
        task = load.task
        raw = self.payload[:load.raw_length]
        return self.copier.copy_device_payload(CopyTask(raw, task.group, task.gpu_ids, task.skip), to_slot=False)

    # -- ending a block ----------------------------------------------------------------------------
    def _run(self, work: _Work) -> Issued:
        return self._encode(work.item) if work.store else self._decode(work.item)

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

    def _submit(self, work: _Work) -> None:
        self._queued.put(work)

    def _run_queued(self) -> None:
        """The CPU platform's thread: each block's work, then its end."""
        while True:
            work = self._queued.get()
            if work is None:
                return
            try:
                bad, stored, _ = self._run(work)
                failed = bool(bad)
            except Exception as error:  # noqa: BLE001 - a failed block, not a failed engine
                self._fail(work, error)
                continue
            self._finish(work, failed, stored)

    # -- CUDA --------------------------------------------------------------------------------------
    def _issue_queued(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            work = self._queued.get()
            if work is None:
                self._pending.put(None)
                return
            self._free_flags.acquire()
            index, self._next_flag = self._next_flag, (self._next_flag + 1) % FLAGS
            try:
                if work.task.after is not None:
                    self._stream.wait_event(work.task.after)
                else:
                    self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    bad, stored, keep = self._run(work)
                    self._flags[index].copy_(bad, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
            except Exception as error:  # noqa: BLE001
                self._free_flags.release()
                self._fail(work, error)
                continue
            self._pending.put((work, index, stored, event, keep))

    def _poll(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            work, index, stored, event, _keep = item
            try:
                event.synchronize()
                bad = bool(self._flags[index])
            except Exception as error:  # noqa: BLE001
                self._free_flags.release()
                self._fail(work, error)
                continue
            self._free_flags.release()
            self._finish(work, bad, stored)


class DeviceFp8(DeviceCodec):
    """``fp8`` stores and loads on the KV's device; ``payload_lengths``: the raw payload length of
    each KV group's storage blocks (whole groups of the codec, else ``InputError`` at start)."""

    name = "fp8"

    def __init__(self, codec: Fp8Codec, copier: TorchCopier, payload_lengths: Sequence[int], *,
                 streams: bool | None = None) -> None:
        for length in payload_lengths:
            if length % (2 * codec.group):
                raise InputError(f"codec fp8: a storage block of {length} bytes is not whole groups of "
                                 f"{codec.group} values; use codec none or planes-zstd for this model")
        largest = max(payload_lengths, default=0)
        super().__init__(codec.params, copier, largest, streams=streams)
        self.codec = codec
        self._stored = torch.empty(codec.stored_length(largest), dtype=torch.uint8, device=self.device)

    def _refusal(self, load: CodedLoad) -> str | None:
        refused = super()._refusal(load)
        if refused is None and load.raw_length % (2 * self.codec.group):
            return f"a coded block of {load.raw_length} raw bytes"
        if refused is None and load.task.payload.numel() != self.codec.stored_length(load.raw_length):
            return f"{load.task.payload.numel()} stored bytes for {load.raw_length} raw"
        return refused

    def _encode(self, task: CopyTask) -> Issued:
        raw = self.payload[:task.payload.numel()]
        keep = self.copier.copy_device_payload(CopyTask(raw, task.group, task.gpu_ids, task.skip), to_slot=True)
        codes, scales, bad = quantize(raw.view(self.codec.torch_dtype), self.codec.group)
        head = scales.numel()  # one byte each
        slot = task.payload.view(torch.uint8)
        slot[:head].copy_(scales, non_blocking=self.cuda)
        slot[head:head + codes.numel()].copy_(codes, non_blocking=self.cuda)
        return bad, head + codes.numel(), (keep, codes, scales)

    def _decode(self, load: CodedLoad) -> Issued:
        stored = self._stored[:load.task.payload.numel()]
        stored.copy_(load.task.payload.view(torch.uint8), non_blocking=self.cuda)
        bad = decode_tensor(stored, self.payload[:load.raw_length].view(torch.uint8), self.codec)
        return bad, None, self._into_kv(load)
