"""zstd frames decoded into device memory: the frame decoders of the GPU codec steps.

``NvcompFrames`` (``nvidia-nvcomp-cu12`` or ``-cu13``, matching torch's CUDA) decodes a step's
frames in one batched call; ``HostFrames`` (zstandard on the host, one frame at a time) is the
reference the tests run the device steps with; the engine never uses it (without nvCOMP the codec
threads decode, ``connector.codecs.device_codec_for``). ``lying_frame`` builds
the hostile frame the start check (``device_zstd.DeviceZstdFrames.self_test``) feeds them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import zstandard

from pykv.codec.base import CodecError
from pykv.codec.lossless import PlanesZstdCodec
from pykv.errors import InputError

from pykv.connector.nvcomp_batched import BatchedZstd


def lying_frame(declared: int, holding: int) -> bytes:
    """A zstd frame whose header declares ``declared`` bytes but whose blocks hold ``holding``:
    what a hostile writer could store; ``check_frame`` passes it, decoding must refuse it."""
    data = (np.arange(holding) % 7).astype(np.uint8).tobytes()
    frame = bytearray(zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data))
    descriptor = frame[4]  # after the 4-byte magic number
    single = (descriptor >> 5) & 1
    position = 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3]
    size = (1 if single else 0, 2, 4, 8)[descriptor >> 6]
    value = declared - 256 if size == 2 else declared  # the 2-byte field stores the size less 256
    if not 0 <= value < 1 << (8 * size):
        raise ValueError(f"{declared} bytes do not fit the frame's {size}-byte size field")
    frame[position:position + size] = value.to_bytes(size, "little")
    return bytes(frame)


class FrameDecoder(Protocol):
    def decode(self, source: torch.Tensor, frames: np.ndarray, target: torch.Tensor,
               outputs: np.ndarray) -> tuple[torch.Tensor, object]:
        """Decode each zstd frame (row ``(offset, length)`` of ``frames``: bytes of the flat uint8
        ``source``) into its output (the same row of ``outputs``: bytes of the flat uint8
        ``target``, exactly filled) on the current stream. Returns a 0-d bool tensor on the
        target's device (True if a frame did not decode to exactly its output) and what must
        live until the stream passes the work. May raise ``CodecError`` (a miss)."""


class HostFrames:
    """Frames decoded by zstandard on the host (``codec.inflate``, one at a time), then copied to
    their outputs."""

    def __init__(self, codec: PlanesZstdCodec) -> None:
        self.codec = codec

    def decode(self, source: torch.Tensor, frames: np.ndarray, target: torch.Tensor,
               outputs: np.ndarray) -> tuple[torch.Tensor, object]:
        host = source.cpu().numpy()
        for (offset, length), (into, size) in zip(frames.tolist(), outputs.tolist()):
            plane = np.empty(size, dtype=np.uint8)
            self.codec.inflate(memoryview(host[offset:offset + length]), plane)
            target[into:into + size].copy_(torch.from_numpy(plane))
        return torch.zeros((), dtype=torch.bool, device=target.device), None


class DeviceBytes:
    """``length`` bytes of device memory at ``address`` as a CUDA Array Interface (v3) object:
    how a step hands nvCOMP its frames and planes without a torch call per frame."""

    __slots__ = ("_interface",)

    def __init__(self, address: int, length: int) -> None:
        self._interface = {"shape": (length,), "typestr": "|u1", "data": (address, False), "strides": None,
                           "version": 3, "stream": None}  # None: the work is ordered on nvCOMP's stream

    @property
    def __cuda_array_interface__(self) -> dict:
        return self._interface


class NvcompFrames:
    """nvCOMP's batched zstd decoder for standard frames (``BitstreamKind.RAW``) on ``stream``.
    ``InputError`` (one line) where nvCOMP is not installed or does not load. ``mode`` (chosen by
    the start check): ``batched`` calls nvCOMP's C API once per step with a device table of the
    frames, each frame's decoded length checked on the device (``nvcomp_batched``); ``sized``
    decodes into the outputs with a decompression config built from their sizes (nvCOMP neither
    reads the headers back nor synchronizes the stream); ``into`` decodes straight into the
    outputs (``out=``: no allocation per frame, no copy; nvCOMP reads the headers, synchronizing
    the stream); ``copy`` into nvCOMP's own arrays, each checked for its size, then all copied in
    one ``_foreach_copy_``. Frames and outputs go to the Python API as ``DeviceBytes``, or, in the
    ``-slices`` modes (where nvCOMP refuses those), as torch slices."""

    modes = ("batched", "sized", "into", "sized-slices", "into-slices", "copy")
    unseen_modes = ("copy",)  # outputs nvCOMP allocates: a write past them is out of the start check's sight
    mode = "copy"  # until the start check chooses
    _CONFIGS = 64  # decompression configs kept, by the step's tuple of plane sizes

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
        self._device = device
        self._configs: dict[tuple[int, ...], object] = {}
        self._batched: BatchedZstd | None = None

    def _config(self, sizes: tuple[int, ...]) -> object:
        config = self._configs.get(sizes)
        if config is None:
            if len(self._configs) >= self._CONFIGS:
                self._configs.clear()
            config = self._configs[sizes] = self._codec.decompression_config(
                self._codec.compression_config(list(sizes)))
        return config

    def reserve(self, count: int, largest: int, total: int) -> None:
        """In the ``batched`` mode, its scratch for a step (``BatchedZstd.reserve``); the Python
        API allocates per call."""
        if self.mode == "batched":
            self._batched_decoder().reserve(count, largest, total)

    def _batched_decoder(self) -> BatchedZstd:
        if self._batched is None:
            self._batched = BatchedZstd(self._device)
        return self._batched

    def _arrays(self, buffer: torch.Tensor, spans: np.ndarray) -> object:
        """The spans of ``buffer`` as one nvCOMP batch."""
        if self.mode in ("sized", "into"):
            base = buffer.data_ptr()
            items: list = [DeviceBytes(base + offset, length) for offset, length in spans.tolist()]
        else:
            items = [buffer[offset:offset + length] for offset, length in spans.tolist()]
        # one batch (as_arrays): nvCOMP 6's decode takes an Array or such a batch, not a list of Arrays
        return self._nvcomp.as_arrays(items, cuda_stream=self._stream)

    def decode(self, source: torch.Tensor, frames: np.ndarray, target: torch.Tensor,
               outputs: np.ndarray) -> tuple[torch.Tensor, object]:
        if self.mode == "batched":
            return self._batched_decoder().decode(source, frames, target, outputs)
        arrays = self._arrays(source, frames)
        bad = torch.zeros((), dtype=torch.bool, device=target.device)
        if self.mode != "copy":
            targets = self._arrays(target, outputs)
            if self.mode.startswith("sized"):
                config = self._config(tuple(outputs[:, 1].tolist()))
                self._codec.decode(arrays, out=targets, decompression_config=config)
            else:
                self._codec.decode(arrays, out=targets)
            return bad, (arrays, targets)
        decoded_arrays = self._codec.decode(arrays)
        sources, targets = [], []
        for (into, size), array in zip(outputs.tolist(), decoded_arrays):
            decoded = torch.as_tensor(array, device=target.device).view(torch.uint8).reshape(-1)
            if decoded.numel() != size:
                raise CodecError("zstd", f"a frame decoded to {decoded.numel()} bytes on the GPU, not {size}")
            sources.append(decoded)
            targets.append(target[into:into + size])
        torch._foreach_copy_(targets, sources, non_blocking=True)  # a few kernels for all frames, not one each
        return bad, (arrays, decoded_arrays, sources)
