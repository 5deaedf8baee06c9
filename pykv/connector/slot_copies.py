"""``SlotCopies``: a worker's copies between the engine's KV blocks and the staging slots.

The ``BlockStore`` asks its client to fill slots (stores) and to empty them (loads); this
turns each request into copier and codec work: raw blocks straight through the copier;
``fp8`` (and ``planes-zstd``/``fp8-zstd`` frames with nvCOMP) on the KV's device
(``device_codec``); ``planes-zstd`` otherwise on the codec threads (``codec_stage``), into a
scratch buffer then through the copier; ``fp8-zstd`` without nvCOMP: its zstd layer on the
codec threads, its fp8 step on the device. A load never changes a slot's bytes (a DRAM-tier
slot serves the next hit as it is).
"""

from __future__ import annotations

import torch

from pykv.codec.stage import CodecStage
from pykv.failures import BlockFailure, Step
from pykv.format import HEADER_SIZE
from pykv.format_codec import NONE
from pykv.staging import StagingPool
from pykv.store import CopyDone, SlotCopy

from pykv.connector.copier import CopyTask, TorchCopier
from pykv.connector.device_codec import CodedLoad, DeviceCodec


class SlotCopies:
    """The store client's ``to_slots`` and ``from_slots`` over ``pool``'s slots (thread-safe)."""

    def __init__(self, pool: StagingPool, copier: TorchCopier, device_codec: DeviceCodec | None,
                 codec_stage: CodecStage | None) -> None:
        self.pool, self.copier, self.device_codec, self.codec_stage = pool, copier, device_codec, codec_stage
        self._slot_tensors = [torch.frombuffer(pool.view(s), dtype=torch.int8) for s in range(pool.num_slots)]
        self._scratch_tensors = [] if codec_stage is None else [
            torch.frombuffer(codec_stage.view(b), dtype=torch.int8) for b in range(codec_stage.scratch.num_slots)]

    def close(self) -> None:
        """Drop the views (before the pool and the codec stage free their memory)."""
        self._scratch_tensors.clear()
        self._slot_tensors.clear()

    def _tasks(self, copies: list[SlotCopy]) -> list[CopyTask]:
        """Each copy with its chunk (``SlotCopy.target``) as the copier's task (stores' chunks never skip)."""
        return [CopyTask(self._slot_tensors[c.slot][HEADER_SIZE:HEADER_SIZE + c.length], c.target.group,
                         c.target.gpu_ids, c.target.skip, token=c, after=c.target.ready) for c in copies]

    def to_slots(self, copies: list[SlotCopy], done: CopyDone) -> None:
        """The KV into the slots, then (with a codec) each payload encoded in its slot; fp8 encodes
        on the device and copies only the stored bytes (fp8-zstd: then coded on the codec threads)."""
        stage = self.codec_stage
        if self.device_codec is not None and self.device_codec.encodes:
            layered = self.device_codec.host_layer
            self.device_codec.store(self._tasks(copies), lambda task, ok, stored: self._recode(
                task.token, ok, stored, done) if layered else done(task.token, ok, stored=stored))
            return
        if stage is None:
            self.copier.to_slots(self._tasks(copies), lambda task, ok: done(task.token, ok))
            return

        def copied(task: CopyTask, ok: bool) -> None:
            copy: SlotCopy = task.token
            if not ok:
                done(copy, False)
                return
            payload = self.pool.view(copy.slot)[HEADER_SIZE:HEADER_SIZE + copy.length]
            stage.encode(payload, lambda stored: done(copy, True, stored=stored))

        self.copier.to_slots(self._tasks(copies), copied)

    def _recode(self, copy: SlotCopy, ok: bool, stored: int | None, done: CopyDone) -> None:
        """A device step's stored bytes coded once more by the codec threads (``fp8-zstd``)."""
        payload = self.pool.view(copy.slot)[HEADER_SIZE:HEADER_SIZE + copy.length]
        if ok and stored is not None:
            self.codec_stage.recode(payload, stored, lambda coded: done(copy, coded is not None, stored=coded))
        else:
            done(copy, False)

    def from_slots(self, copies: list[SlotCopy], done: CopyDone) -> None:
        """Raw blocks straight to the copier (one batch); coded ones decoded first, each on its own
        (on the KV's device for fp8 and, with ``codec_decode``, planes-zstd; else on the codec threads)."""
        raw = [c for c in copies if c.codec == NONE]
        if raw:
            self.copier.from_slots(self._tasks(raw), lambda task, ok: done(task.token, ok))
        coded = [c for c in copies if c.codec != NONE]
        device = self.device_codec
        if coded and device is not None and not device.host_frames:
            loads = [CodedLoad(task, task.token.decoded_length or 0, task.token.codec) for task in self._tasks(coded)]
            device.load(loads, lambda task, ok, failure: done(task.token, ok, failure=failure))
            return
        stage = self.codec_stage
        for copy in coded:
            length, params = copy.decoded_length or 0, copy.codec
            if device is not None and stage is not None:  # fp8-zstd: its zstd layer here, its fp8 on the device
                length, params = device.unlayered(copy.codec, length), stage.params
            if stage is None or length is None:  # not one of ours
                done(copy, False, failure=BlockFailure(Step.CHECK, detail=f"a block of codec {copy.codec[:80]!r} "
                                                       f"and {copy.decoded_length} raw bytes, not this engine's"))
                continue
            stored = self.pool.view(copy.slot)[HEADER_SIZE:HEADER_SIZE + copy.length]
            stage.decode(stored, length, params, lambda buffer, failure, copy=copy, length=length:
                         self._copy_decoded(copy, buffer, length, failure, done))

    def _copy_decoded(self, copy: SlotCopy, buffer: int | None, length: int, failure: BlockFailure | None,
                      done: CopyDone) -> None:
        """(Codec thread.) A decoded block from its scratch buffer to the engine (through the device
        codec where it has a host layer), then the buffer is free."""
        if buffer is None:
            done(copy, False, failure=failure)
            return
        stage, target = self.codec_stage, copy.target
        task = CopyTask(self._scratch_tensors[buffer][:length], target.group, target.gpu_ids,
                        target.skip, token=copy, after=target.ready)

        def copied(_task: CopyTask, ok: bool, failure: BlockFailure | None = None) -> None:
            stage.release(buffer)
            done(copy, ok, failure=failure)

        if self.device_codec is not None:
            self.device_codec.load([CodedLoad(task, copy.decoded_length or 0, copy.codec)], copied)
        else:
            self.copier.from_slots([task], copied)
