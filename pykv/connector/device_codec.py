"""``fp8`` in the engine: blocks quantized and dequantized on the KV cache's own device.

A store gathers the block's pages into a payload on the device, quantizes it there and copies
the scales and codes (about half the bytes) into the staging slot. A load copies the stored
bytes to the device, dequantizes them into the payload and copies its pages to the KV cache
blocks. A load never changes the slot, so a DRAM-tier slot serves every later hit.

On CUDA one thread issues every block's work on one stream, in order, so the device scratch
(one payload, one stored block) is reused in stream order and nothing waits for the device
while issuing; a poller thread waits for each block's event, then reads the block's bad-input
flag, a page-locked byte the device wrote: NaN or infinite KV fails a store, scales or codes
the encoder never writes fail a load (``Step.CHECK``: a miss, recomputed and quarantined).
On the CPU platform the same functions run on the caller's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pykv.codec.fp8 import Fp8Codec, decode_tensor, quantize
from pykv.errors import InputError
from pykv.failures import BlockFailure, Step

from pykv.connector.copier import CopyTask, TorchCopier

log = logging.getLogger(__name__)

StoreDone = Callable[[CopyTask, bool, "int | None"], None]
"""``done(task, ok, stored)``: ``stored`` bytes of codes and scales at the start of the slot's payload."""
LoadDone = Callable[[CopyTask, bool, "BlockFailure | None"], None]
FLAGS = 64
"""Blocks in flight on the device at most (each holds one page-locked flag byte until it is read)."""


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


class DeviceFp8:
    """Encodes stores and decodes loads of ``codec`` on the device of ``copier``'s KV tensors;
    ``payload_lengths``: the raw payload length of each KV group's storage blocks."""

    def __init__(self, codec: Fp8Codec, copier: TorchCopier, payload_lengths: Sequence[int], *,
                 streams: bool | None = None) -> None:
        for length in payload_lengths:
            if length % (2 * codec.group):
                raise InputError(f"codec fp8: a storage block of {length} bytes is not whole groups of "
                                 f"{codec.group} values; use codec none or planes-zstd for this model")
        self.codec, self.copier = codec, copier
        self.params = codec.params
        self.device = copier.tensors[0].device
        largest = max(payload_lengths, default=0)
        self._raw = torch.empty(largest, dtype=torch.int8, device=self.device)
        self._stored = torch.empty(codec.stored_length(largest), dtype=torch.uint8, device=self.device)
        self._lock = threading.Lock()  # the CPU platform: callers share the scratch
        self.cuda = self.device.type == "cuda" if streams is None else streams  # (tests: fake streams on the CPU)
        if self.cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            self._flags = torch.zeros(FLAGS, dtype=torch.bool, pin_memory=self.device.type == "cuda")
            self._free_flags = threading.Semaphore(FLAGS)
            self._next_flag = 0
            self._queued: queue.Queue = queue.Queue()
            self._pending: queue.Queue = queue.Queue()
            self._threads = [threading.Thread(target=target, name=name, daemon=True)
                             for name, target in (("pykv-fp8-issue", self._issue_queued), ("pykv-fp8-events", self._poll))]
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
        if self.cuda:
            self._queued.put(None)
            for thread in self._threads:
                thread.join(timeout)

    # -- one block ---------------------------------------------------------------------------------
    def _refusal(self, load: CodedLoad) -> str | None:
        if load.params != self.params:
            return f"a block of codec {load.params}, this engine's is {self.params}"
        if not 0 < load.raw_length <= self._raw.numel() or load.raw_length % (2 * self.codec.group):
            return f"a coded block of {load.raw_length} raw bytes"
        if load.task.payload.numel() != self.codec.stored_length(load.raw_length):
            return f"{load.task.payload.numel()} stored bytes for {load.raw_length} raw"
        return None

    def _run(self, work: _Work) -> tuple[torch.Tensor, int | None, object]:
        """Queue ``work`` on the current stream: (its bad-input flag, the stored length of a store,
        what must live until the stream passes it)."""
        if work.store:
            task = work.item
            raw = self._raw[:task.payload.numel()]
            keep = self.copier.copy_device_payload(CopyTask(raw, task.group, task.gpu_ids, task.skip), to_slot=True)
            codes, scales, bad = quantize(raw.view(self.codec.torch_dtype), self.codec.group)
            head = scales.numel()  # one byte each
            slot = task.payload.view(torch.uint8)
            slot[:head].copy_(scales, non_blocking=self.cuda)
            slot[head:head + codes.numel()].copy_(codes, non_blocking=self.cuda)
            return bad, head + codes.numel(), (keep, codes, scales)
        load: CodedLoad = work.item
        task = load.task
        stored = self._stored[:task.payload.numel()]
        stored.copy_(task.payload.view(torch.uint8), non_blocking=self.cuda)
        raw = self._raw[:load.raw_length]
        bad = decode_tensor(stored, raw.view(torch.uint8), self.codec)
        keep = self.copier.copy_device_payload(CopyTask(raw, task.group, task.gpu_ids, task.skip), to_slot=False)
        return bad, None, keep

    @staticmethod
    def _finish(work: _Work, bad: bool, stored: int | None) -> None:
        task = work.item if work.store else work.item.task
        if not work.store:
            work.done(task, not bad, BlockFailure(Step.CHECK, detail="fp8: a scale or code the encoder never "
                                                                     "writes") if bad else None)
        elif bad:
            log.warning("pykv: a block's KV holds NaN or infinite values; not stored (codec fp8)")
            work.done(task, False, None)
        else:
            work.done(task, True, stored)

    @staticmethod
    def _fail(work: _Work) -> None:
        log.exception("pykv: fp8 %s on the device failed", "encoding" if work.store else "decoding")
        task = work.item if work.store else work.item.task
        if work.store:
            work.done(task, False, None)
        else:
            work.done(task, False, BlockFailure(Step.COPY, detail="fp8 decoding on the device failed"))

    def _submit(self, work: _Work) -> None:
        if self.cuda:
            self._queued.put(work)
            return
        try:
            with self._lock:
                bad, stored, _ = self._run(work)
                failed = bool(bad)
        except Exception:  # noqa: BLE001 - a failed block, not a failed engine
            self._fail(work)
            return
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
            task = work.item if work.store else work.item.task
            try:
                if task.after is not None:
                    self._stream.wait_event(task.after)
                else:
                    self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    bad, stored, keep = self._run(work)
                    self._flags[index].copy_(bad, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
            except Exception:  # noqa: BLE001
                self._free_flags.release()
                self._fail(work)
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
            except Exception:  # noqa: BLE001
                self._free_flags.release()
                self._fail(work)
                continue
            self._free_flags.release()
            self._finish(work, bad, stored)
