"""``planes-zstd`` loads decoded on the GPU (``codec_decode``: ``gpu``, or ``auto`` where nvCOMP works).

The stored bytes go to the device as they are (about 0.68 of the KV's bytes over PCIe); every
zstd frame of a step's blocks (``DeviceCodec``: the loads queued at once) is decoded in one call
of a frame decoder (nvCOMP's batched zstd) into a device buffer of planes, raw planes are copied
there, the planes are interleaved into the payloads (byte 0 of each value from plane 0, byte 1
from plane 1) and the payloads' pages go to the KV blocks device to device. The host reads only the block's table and each frame's header
(``PlanesZstdCodec.plane_spans``, ``check_frame``): what the CPU decoder would refuse there is
refused the same way (``Step.CHECK``), before any device work. Stores are still encoded on the
codec threads (``pykv.codec.stage``).

Frame decoders: ``NvcompFrames`` (``nvidia-nvcomp-cu12`` or ``-cu13``, matching torch's CUDA) and
``HostFrames`` (zstandard on the host, one frame at a time: tests and the reference).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Protocol, Sequence

import numpy as np
import torch

from pykv.codec.base import CodecError
from pykv.codec.lossless import PlanesZstdCodec
from pykv.errors import InputError

from pykv.connector.copier import TorchCopier
from pykv.connector.device_codec import STEP_BYTES, CodedLoad, DeviceCodec

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _no_stream():
    yield


class FrameDecoder(Protocol):
    def decode(self, frames: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Decode each uint8 zstd frame into its output (exactly the output's size) on the current
        stream; a 0-d bool tensor on the outputs' device: True if a frame did not decode to
        exactly its output. May raise ``CodecError`` (a miss)."""


class HostFrames:
    """Frames decoded by zstandard on the host, then copied to their outputs."""

    def __init__(self, codec: PlanesZstdCodec) -> None:
        self.codec = codec

    def decode(self, frames: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        for frame, out in zip(frames, outputs):
            plane = np.empty(out.numel(), dtype=np.uint8)
            self.codec.inflate(memoryview(frame.cpu().numpy()), plane)
            out.copy_(torch.from_numpy(plane))
        return torch.zeros((), dtype=torch.bool, device=outputs[0].device if outputs else "cpu")


class NvcompFrames:
    """nvCOMP's batched zstd decoder for standard frames (``BitstreamKind.RAW``) on ``stream``.
    ``InputError`` (one line) where nvCOMP is not installed or does not load."""

    def __init__(self, device: torch.device, stream: object) -> None:
        self._stream = getattr(stream, "cuda_stream", 0)
        try:
            from nvidia import nvcomp
            self._codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW,
                                       device_id=device.index or 0, cuda_stream=self._stream)
        except Exception as exc:  # noqa: BLE001 - not installed, its library does not load, another API
            raise InputError(f"codec_decode=gpu needs nvCOMP (pip install nvidia-nvcomp-cu12 or -cu13, as torch's "
                             f"CUDA): {type(exc).__name__}: {exc}") from None
        self._nvcomp = nvcomp

    def decode(self, frames: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        # one batch (as_arrays): nvCOMP 6's decode takes an Array or such a batch, not a list of Arrays
        arrays = self._nvcomp.as_arrays(list(frames), cuda_stream=self._stream)
        bad = torch.zeros((), dtype=torch.bool, device=outputs[0].device)
        for out, array in zip(outputs, self._codec.decode(arrays)):
            decoded = torch.as_tensor(array, device=out.device).view(torch.uint8).reshape(-1)
            if decoded.numel() != out.numel():
                raise CodecError("planes-zstd", f"a frame decoded to {decoded.numel()} bytes on the GPU, "
                                                f"not {out.numel()}")
            out.copy_(decoded, non_blocking=True)
        return bad


class DevicePlanesZstd(DeviceCodec):
    """Decodes ``planes-zstd`` loads on the KV's device with ``frames``; ``largest_payload``: the
    largest raw payload of the engine's storage blocks."""

    name = "planes-zstd"
    encodes = False
    step_bytes = STEP_BYTES // 2  # its scratch is three times the payload (stored, planes, payload)

    def __init__(self, codec: PlanesZstdCodec, copier: TorchCopier, largest_payload: int,
                 frames: FrameDecoder | None = None, *, streams: bool | None = None,
                 step_blocks: int | None = None) -> None:
        if codec.elem != 2:
            raise InputError(f"codec planes-zstd decodes on the GPU 2-byte values only, not {codec.elem}-byte")
        super().__init__(codec.params, copier, largest_payload, streams=streams, step_blocks=step_blocks)
        self.codec = codec
        self.frames = frames if frames is not None else NvcompFrames(self.device, getattr(self, "_stream", None))
        self._stored_row = codec.encoded_bound(largest_payload)
        self._stored = torch.empty(self._stored_row * self.step_blocks, dtype=torch.uint8, device=self.device)
        self._planes = torch.empty(largest_payload * self.step_blocks, dtype=torch.uint8, device=self.device)

    def self_test(self) -> None:
        """Decode one frame of known bytes with the frame decoder and compare (engine start):
        ``InputError`` (one line) if it fails or differs."""
        import zstandard
        plane = (np.arange(1 << 16) % 251).astype(np.uint8)
        frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(plane.tobytes())
        source = torch.from_numpy(np.frombuffer(frame, dtype=np.uint8).copy()).to(self.device)
        out = torch.zeros(plane.size, dtype=torch.uint8, device=self.device)
        try:
            with torch.cuda.stream(self._stream) if self.device.type == "cuda" else _no_stream():
                bad = self.frames.decode([source], [out])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            same = not bool(bad) and np.array_equal(out.cpu().numpy(), plane)
        except Exception as exc:  # noqa: BLE001 - any failure of the decoder refuses it
            raise InputError(f"codec_decode: the GPU zstd decoder failed its start check: {type(exc).__name__}: "
                             f"{exc}") from None
        if not same:
            raise InputError("codec_decode: the GPU zstd decoder failed its start check (wrong bytes)")

    def _refusal(self, load: CodedLoad) -> str | None:
        refused = super()._refusal(load)
        if refused is None and (load.raw_length % 2 or load.task.payload.numel() > self._stored_row):
            return f"{load.task.payload.numel()} stored bytes for {load.raw_length} raw"
        return refused

    def _decode_step(self, loads: Sequence[CodedLoad]) -> tuple[torch.Tensor, object]:
        """Every zstd frame of the loads in one call of the frame decoder (raw planes copied),
        the planes of all rows interleaved at once, one scatter into the KV blocks. A frame
        decoder's bad flag fails every load of the step."""
        count, raw = len(loads), loads[0].raw_length
        half = raw // 2
        frames, outputs = [], []
        for row, load in enumerate(loads):
            host = load.task.payload.view(torch.uint8).numpy()  # the page-locked slot: read in place
            chunks = self.codec.plane_spans(host, raw)
            stored = self._stored[row * self._stored_row:row * self._stored_row + host.size]
            stored.copy_(load.task.payload.view(torch.uint8), non_blocking=self.cuda)
            planes = self._planes[row * raw:(row + 1) * raw]
            for start, size, spans in chunks:
                for plane, (position, length) in enumerate(spans):
                    into = planes[plane * half + start // 2:plane * half + (start + size) // 2]
                    if length == size // 2:
                        into.copy_(stored[position:position + length], non_blocking=self.cuda)
                    else:
                        self.codec.check_frame(host[position:position + length], size // 2)
                        frames.append(stored[position:position + length])
                        outputs.append(into)
        bad = self.frames.decode(frames, outputs) if frames else torch.zeros((), dtype=torch.bool, device=self.device)
        values = self.payload[:count * raw].view(torch.uint8).view(count, half, 2)
        planes = self._planes[:count * raw].view(count, 2, half)
        values[:, :, 0].copy_(planes[:, 0])
        values[:, :, 1].copy_(planes[:, 1])
        return bad.reshape(1).expand(count), (self._into_kv_rows(loads), frames)
