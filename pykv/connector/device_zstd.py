"""``planes-zstd`` loads decoded on the GPU (``codec_decode``: ``gpu``, or ``auto`` where nvCOMP works).

The stored bytes go to the device as they are (about 0.68 of the KV's bytes over PCIe); every
zstd frame of a step's blocks (``DeviceCodec``: the loads queued at once) is decoded in one call
of a frame decoder (nvCOMP's batched zstd) into a device buffer of planes, raw planes are copied
there, the planes are interleaved into the payloads (byte 0 of each value from plane 0, byte 1
from plane 1) and the payloads' pages are scattered into the KV blocks (``scatter``). The host
reads only the block's table and each frame's header (``PlanesZstdCodec.plane_spans``,
``check_frame``): what the CPU decoder would refuse there is refused the same way
(``Step.CHECK``), before any device work. nvCOMP 6.0 does not check a frame's body against the
size its header declares (the start check, ``self_test``, finds out), so it is used only where
the stored bytes' checksum or MAC is verified before decoding, and never if it writes outside a
plane; each step's planes are zeroed first, so a short frame shows zeros, never an earlier step's
bytes. Stores are still encoded on the codec threads (``pykv.codec.stage``).

Frame decoders: ``NvcompFrames`` (``nvidia-nvcomp-cu12`` or ``-cu13``, matching torch's CUDA) and
``HostFrames`` (zstandard on the host, one frame at a time: tests and the reference).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Protocol, Sequence

import numpy as np
import torch
import zstandard

from pykv.codec.base import CodecError
from pykv.codec.lossless import PlanesZstdCodec
from pykv.errors import InputError

from pykv.connector.copier import TorchCopier
from pykv.connector.device_codec import STEP_BYTES, CodedLoad, DeviceCodec

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _no_stream():
    yield


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
    """Frames decoded by zstandard on the host, then copied to their outputs."""

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
    the start check): ``sized`` decodes into the outputs with a decompression config built from
    their sizes (nvCOMP neither reads the headers back nor synchronizes the stream); ``into``
    decodes straight into the outputs (``out=``: no allocation per frame, no copy; nvCOMP reads
    the headers, synchronizing the stream); ``copy`` into nvCOMP's own arrays, each checked for
    its size and copied. Frames and outputs go to nvCOMP as ``DeviceBytes``, or, in the
    ``-slices`` modes (where nvCOMP refuses those), as torch slices."""

    modes = ("sized", "into", "sized-slices", "into-slices", "copy")
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
        self._configs: dict[tuple[int, ...], object] = {}

    def _config(self, sizes: tuple[int, ...]) -> object:
        config = self._configs.get(sizes)
        if config is None:
            if len(self._configs) >= self._CONFIGS:
                self._configs.clear()
            config = self._configs[sizes] = self._codec.decompression_config(
                self._codec.compression_config(list(sizes)))
        return config

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
        for (into, size), array in zip(outputs.tolist(), decoded_arrays):
            decoded = torch.as_tensor(array, device=target.device).view(torch.uint8).reshape(-1)
            if decoded.numel() != size:
                raise CodecError("planes-zstd", f"a frame decoded to {decoded.numel()} bytes on the GPU, not {size}")
            target[into:into + size].copy_(decoded, non_blocking=True)
        return bad, (arrays, decoded_arrays)


class DevicePlanesZstd(DeviceCodec):
    """Decodes ``planes-zstd`` loads on the KV's device with ``frames``; ``largest_payload``: the
    largest raw payload of the engine's storage blocks; ``checked``: the stored bytes' checksum or
    MAC is verified before a load gets here (``verify=full`` or ``auth_key_file``)."""

    name = "planes-zstd"
    encodes = False
    step_bytes = STEP_BYTES // 2  # its scratch is three times the payload (stored, planes, payload)

    def __init__(self, codec: PlanesZstdCodec, copier: TorchCopier, largest_payload: int,
                 frames: FrameDecoder | None = None, *, checked: bool = True, streams: bool | None = None,
                 step_blocks: int | None = None) -> None:
        if codec.elem != 2:
            raise InputError(f"codec planes-zstd decodes on the GPU 2-byte values only, not {codec.elem}-byte")
        super().__init__(codec.params, copier, largest_payload, streams=streams, step_blocks=step_blocks)
        self.codec, self.checked = codec, checked
        self.lax_frames = False  # the start check: lying frames decode without an error (``checked`` needed)
        self.frames = frames if frames is not None else NvcompFrames(self.device, getattr(self, "_stream", None))
        self._stored_row = codec.encoded_bound(largest_payload)
        self._stored = torch.empty(self._stored_row * self.step_blocks, dtype=torch.uint8, device=self.device)
        self._planes = torch.empty(largest_payload * self.step_blocks, dtype=torch.uint8, device=self.device)

    def self_test(self) -> None:
        """The frame decoder's start check: one frame of known bytes decoded and compared, and
        frames holding fewer or more bytes than their header declares either refused (as the CPU
        decoder refuses them) or decoded without a byte written outside their plane, which the
        engine accepts only where ``checked`` (the stored bytes' checksum or MAC is verified before
        decoding: ``lax_frames`` says so). A decoder with several ``modes`` keeps the first that
        passes; ``InputError`` (one line) if none does."""
        problems = []
        for mode in getattr(self.frames, "modes", (None,)):
            if mode is not None:
                self.frames.mode = mode
            problem = self._unfit()
            if problem is None:
                log.info("pykv: planes-zstd frames decode on the GPU%s%s%s", f" {mode}" if mode else "",
                         "; it does not refuse a frame whose body holds another size than its header "
                         "declares: the stored bytes' checksum guards loads" if self.lax_frames else "",
                         f" ({'; '.join(problems)})" if problems else "")
                return
            problems.append(problem if mode is None else f"{mode}: {problem}")
        raise InputError(f"codec_decode: the GPU zstd decoder failed its start check ({'; '.join(problems)})")

    _GUARD = 1 << 16  # bytes checked on each side of a start-check plane

    def _unfit(self) -> str | None:
        """Why the frame decoder cannot be trusted with hostile frames, or None (``lax_frames``:
        whether it decoded a lying frame without an error, inside its plane)."""
        plane = (np.arange(1 << 16) % 251).astype(np.uint8)
        good = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(plane.tobytes())
        lying = {how: lying_frame(plane.size, plane.size + change) for how, change in (("fewer", -4096),
                                                                                        ("more", 4096))}
        guarded = torch.full((plane.size + 2 * self._GUARD,), 0xAB, dtype=torch.uint8, device=self.device)
        out = guarded[self._GUARD:self._GUARD + plane.size]
        try:
            bad = self._decode_now(good, out)
            if bad or not np.array_equal(out.cpu().numpy(), plane):
                return "wrong bytes"
        except Exception as exc:  # noqa: BLE001 - any failure of the decoder refuses it
            return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if self._overran(guarded):
            return "a frame wrote outside its plane"
        self.lax_frames = False
        for how, frame in lying.items():
            guarded.fill_(0xAB)
            out.zero_()
            try:
                refused = self._decode_now(frame, out)
            except Exception:  # noqa: BLE001 - refused: what the start check wants
                refused = True
            if self._overran(guarded):
                return f"a frame holding {how} bytes than it declares wrote outside its plane"
            if not refused:
                if not self.checked:
                    return (f"a frame holding {how} bytes than it declares decoded without an error, and "
                            "verify=header leaves nothing to catch it (verify=full or auth_key_file)")
                self.lax_frames = True
        return None

    def _overran(self, guarded: torch.Tensor) -> bool:
        outside = guarded.cpu().numpy()
        return bool((outside[:self._GUARD] != 0xAB).any() or (outside[-self._GUARD:] != 0xAB).any())

    def _decode_now(self, frame: bytes, out: torch.Tensor) -> bool:
        source = torch.from_numpy(np.frombuffer(frame, dtype=np.uint8).copy()).to(self.device)
        with torch.cuda.stream(self._stream) if self.device.type == "cuda" else _no_stream():
            bad, _ = self.frames.decode(source, np.array([[0, len(frame)]]), out, np.array([[0, out.numel()]]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return bool(bad)

    def _refusal(self, load: CodedLoad) -> str | None:
        refused = super()._refusal(load)
        if refused is None and (load.raw_length % 2 or load.task.payload.numel() > self._stored_row):
            return f"{load.task.payload.numel()} stored bytes for {load.raw_length} raw"
        return refused

    def _decode_step(self, loads: Sequence[CodedLoad]) -> tuple[torch.Tensor, object]:
        """The step's stored bytes to the device in one copy call (zstd frames packed into the
        stored scratch, raw planes straight into the planes scratch), every frame in one call of
        the frame decoder, the planes of all rows interleaved at once, one scatter into the KV
        blocks: a few torch calls per step, none per frame (``pykv.gil``). A frame decoder's bad
        flag fails every load of the step."""
        count, raw = len(loads), loads[0].raw_length
        half = raw // 2
        slots = [load.task.payload for load in loads]
        moves: list[tuple[int, int, int, int, int]] = []  # (slot, at, 0 stored | 1 planes, to, length)
        frames: list[tuple[int, int]] = []  # (offset in the stored scratch, length)
        outputs: list[tuple[int, int]] = []  # (offset in the planes scratch, length)
        packed = 0
        for row, slot in enumerate(slots):
            host = slot.numpy().view(np.uint8)  # the page-locked slot: read in place
            for start, size, spans in self.codec.plane_spans(host, raw):
                for plane, (position, length) in enumerate(spans):
                    into = row * raw + plane * half + start // 2
                    if length == size // 2:
                        moves.append((row, position, 1, into, length))
                        continue
                    self.codec.check_frame(host[position:position + length], size // 2)
                    moves.append((row, position, 0, packed, length))
                    frames.append((packed, length))
                    outputs.append((into, size // 2))
                    packed += length
        self._planes[:count * raw].zero_()  # a frame nvCOMP leaves short shows zeros, never an earlier step's bytes
        kept = self.copier.copy_ranges(slots, (self._stored, self._planes), np.array(moves, dtype=np.int64),
                                       source_in_order=False)
        calling = time.perf_counter()
        if frames:
            bad, decoding = self.frames.decode(self._stored, np.array(frames, dtype=np.int64), self._planes,
                                               np.array(outputs, dtype=np.int64))
        else:
            bad, decoding = torch.zeros((), dtype=torch.bool, device=self.device), None
        self.stats["codec_frames_us"] += int((time.perf_counter() - calling) * 1e6)
        values = self.payload[:count * raw].view(torch.uint8).view(count, half, 2)
        values.copy_(self._planes[:count * raw].view(count, 2, half).transpose(1, 2))  # byte b from plane b
        return bad.reshape(1).expand(count), (self._into_kv_rows(loads), kept, decoding)
