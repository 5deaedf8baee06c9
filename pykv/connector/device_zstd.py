"""zstd-coded loads decoded on the GPU: ``DeviceZstdFrames`` (the machinery) and
``DevicePlanesZstd`` (``planes-zstd``; ``codec_decode``: ``gpu``, or ``auto`` where nvCOMP works).

The stored bytes go to the device as they are (about 0.68 of the KV's bytes over PCIe for
``planes-zstd``); every zstd frame of a step's blocks (``DeviceCodec``: the loads queued at once)
is decoded in one call of a frame decoder (``zstd_frames``: nvCOMP's batched zstd) into a device
buffer of rows, one per block, raw planes are gathered there (``RawPlanes``), and a codec's last
step turns the rows into payloads (``planes-zstd``: byte 0 of each value from plane 0, byte 1
from plane 1; ``fp8-zstd``: dequantized, ``device_fp8_zstd``) whose pages are scattered into the
KV blocks (``scatter``). The host reads only the blocks' tables and frame headers, all at once
(``step_layout``): what the CPU decoder would refuse there is refused the same way
(``Step.CHECK``), before any device work. nvCOMP 6.0 does not check a frame's body against the
size its header declares, and writes all of one holding more past its output (the start check,
``self_test``, finds out): such a decoder is used only where the stored bytes' MAC is verified
before decoding (a lax one that stays inside its plane: their checksum or MAC); each step's rows
are zeroed first, so a short frame shows zeros, never an earlier step's bytes. ``planes-zstd``
stores are encoded on the codec threads (``pykv.codec.stage``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import zstandard

from pykv.codec.base import CodecError
from pykv.codec.lossless import PlanesZstdCodec
from pykv.errors import InputError

from pykv.connector.copier import TorchCopier
from pykv.connector.device_codec import STEP_BYTES, CodedLoad, DeviceCodec, whole_groups_refusal
from pykv.connector.zstd_frames import FrameDecoder, NvcompFrames, lying_frame

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _no_stream():
    yield


class DeviceZstdFrames(DeviceCodec):
    """Decodes loads stored as ``layer`` (a ``PlanesZstdCodec``) over rows of ``_row_length(raw)``
    bytes with ``frames``; subclasses turn the rows into payloads (``_from_rows``).
    ``largest_row``: the row of the largest raw payload; ``checked``: the stored bytes' checksum
    or MAC is verified before a load gets here (``verify=full`` or ``auth_key_file``);
    ``authenticated``: a MAC is (``auth_key_file``): only frames pykv's encoder made get here."""

    step_bytes = STEP_BYTES // 2  # its scratch: the payloads, their stored bytes and their rows

    def __init__(self, params: str, layer: PlanesZstdCodec, copier: TorchCopier, largest_payload: int,
                 largest_row: int, frames: FrameDecoder | None = None, *, checked: bool = True,
                 authenticated: bool = False, streams: bool | None = None, step_blocks: int | None = None) -> None:
        super().__init__(params, copier, largest_payload, streams=streams, step_blocks=step_blocks)
        self.layer, self.checked, self.authenticated = layer, checked, authenticated
        self.lax_frames = False  # the start check: lying frames decode without an error (``checked`` needed)
        self.overrunning = False  # ... and write outside their plane (``authenticated`` needed)
        try:
            self.frames = frames if frames is not None else NvcompFrames(self.device, getattr(self, "_stream", None))
            self._stored_row = layer.encoded_bound(largest_row)
            self._stored = torch.empty(self._stored_row * self.step_blocks, dtype=torch.uint8, device=self.device)
            self._rows = torch.empty(largest_row * self.step_blocks, dtype=torch.uint8, device=self.device)
            self._raw = RawPlanes(layer, self._rows.numel(), self.device)
        except BaseException:
            self.close()  # the base's threads stop with the half-built decoder (no idle threads left behind)
            raise

    def _row_length(self, raw: int) -> int:
        """The bytes the zstd layer decodes to for a raw payload of ``raw`` bytes."""
        raise NotImplementedError

    def _from_rows(self, rows: torch.Tensor, payloads: torch.Tensor) -> torch.Tensor:
        """The decoded ``rows`` (2-d uint8, one block each) into ``payloads`` (2-d uint8) on the
        stream; one bad-input flag per row."""
        raise NotImplementedError

    def self_test(self) -> None:
        """The frame decoder's start check: one frame of known bytes decoded and compared, and
        frames holding fewer or more bytes than their header declares either refused (as the CPU
        decoder refuses them) or decoded without a byte written outside their plane, which the
        engine accepts only where ``checked`` (the stored bytes' checksum or MAC is verified before
        decoding: ``lax_frames`` says so); a decoder that writes outside the plane for them only
        where ``authenticated`` (``overrunning``: no stored bytes but pykv's own reach it). A
        decoder with several ``modes`` keeps the first that passes; ``InputError`` (one line) if
        none does."""
        problems = []
        for mode in getattr(self.frames, "modes", (None,)):
            if mode is not None:
                self.frames.mode = mode
            problem = self._unfit()
            if problem is None:
                log.info("pykv: %s frames decode on the GPU%s%s%s", self.name, f" {mode}" if mode else "",
                         "; it does not refuse a frame whose body holds another size than its header "
                         "declares (and writes past its plane for one holding more): the MAC guards loads"
                         if self.overrunning else "; it does not refuse a frame whose body holds another "
                         "size than its header declares: the stored bytes' checksum guards loads"
                         if self.lax_frames else "",
                         f" ({'; '.join(problems)})" if problems else "")
                return
            problems.append(problem if mode is None else f"{mode}: {problem}")
        raise InputError(f"codec_decode: the GPU zstd decoder failed its start check ({'; '.join(problems)})")

    _GUARD = 1 << 16  # bytes checked on each side of a start-check plane

    def _unfit(self) -> str | None:
        """Why the frame decoder cannot be trusted with hostile frames, or None (``lax_frames``:
        whether it decoded a lying frame without an error, inside its plane). A mode decoding into
        buffers nvCOMP allocates (``unseen_modes``) is trusted only where ``authenticated``: a
        write past those lies beyond this check's guards."""
        if getattr(self.frames, "mode", None) in getattr(self.frames, "unseen_modes", ()) and not self.authenticated:
            return ("decodes into nvCOMP's own buffers, where a frame holding more bytes than it declares could "
                    "write unseen (kept only with auth_key_file: a MAC over the stored bytes)")
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
        self.lax_frames = self.overrunning = False
        for how, frame in lying.items():
            guarded.fill_(0xAB)
            out.zero_()
            try:
                refused = self._decode_now(frame, out)
            except Exception:  # noqa: BLE001 - refused: what the start check wants
                refused = True
            if self._overran(guarded):
                if not self.authenticated:
                    return (f"a frame holding {how} bytes than it declares wrote outside its plane "
                            "(kept only with auth_key_file: a MAC over the stored bytes)")
                self.overrunning = True
            if not refused:
                if not self.checked:
                    return (f"a frame holding {how} bytes than it declares decoded without an error, and "
                            "verify=header leaves nothing to catch it (verify=full or auth_key_file)")
                self.lax_frames = True
        return self._reserve_step()

    def _reserve_step(self) -> str | None:
        """The frame decoder's scratch for the largest step, taken now (``reserve``, where it has
        one), so a GPU without room for it fails the start check, not every step later."""
        reserve = getattr(self.frames, "reserve", None)
        if reserve is None:
            return None
        largest_row, layer = self._rows.numel() // self.step_blocks, self.layer
        try:
            reserve(self.step_blocks * layer.chunk_count(largest_row) * layer.elem,
                    min(layer.chunk, largest_row) // layer.elem, self._rows.numel())
        except Exception as exc:  # noqa: BLE001 - out of memory, or the library's refusal
            return f"its scratch for a step: {type(exc).__name__}: {exc}".splitlines()[0][:300]
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
        if refused is None and load.task.payload.numel() > self._stored_row:
            return f"{load.task.payload.numel()} stored bytes for {load.raw_length} raw"
        return refused

    def _decode_step(self, loads: Sequence[CodedLoad]) -> tuple[torch.Tensor, object]:
        """The step's stored bytes to the device as they are (one range per block, one copy
        call), every frame decoded from there in one call of the frame decoder, the raw planes
        gathered into the rows (``RawPlanes``), the rows of all loads into payloads at once
        (``_from_rows``), one scatter into the KV blocks: a few torch calls per step, none per
        frame or plane (``pykv.gil``). A frame decoder's bad flag fails every load of the step."""
        count, raw = len(loads), loads[0].raw_length
        row_length = self._row_length(raw)
        slots = [load.task.payload for load in loads]
        layout = step_layout(self.layer, [slot.numpy().view(np.uint8) for slot in slots], row_length,
                             self._stored_row)
        rows = self._rows[:count * row_length]
        rows.zero_()  # a frame nvCOMP leaves short shows zeros, never an earlier step's bytes
        kept = self.copier.copy_ranges(slots, (self._stored,), layout.moves, source_in_order=False)
        calling = time.perf_counter()
        if len(layout.frames):
            bad, decoding = self.frames.decode(self._stored, layout.frames, self._rows, layout.outputs)
        else:
            bad, decoding = torch.zeros((), dtype=torch.bool, device=self.device), None
        self.stats["codec_frames_us"] += int((time.perf_counter() - calling) * 1e6)
        placing = self._raw.place(self._stored, rows.view(count, row_length), layout.raw)
        payloads = self.payload[:count * raw].view(torch.uint8).view(count, raw)
        bad_rows = self._from_rows(rows.view(count, row_length), payloads)
        return bad_rows | bad.reshape(1), (self._into_kv_rows(loads), kept, decoding, placing)


@dataclass(frozen=True)
class StepLayout:
    """Where a step's stored bytes go (int64 arrays): ``moves`` rows ``(slot, 0, 0, to, length)``,
    one per block (its stored bytes, whole, to ``to`` in the stored scratch: the block's row
    times the stored row); ``frames`` ``(offset in the stored scratch, length)`` and ``outputs``
    ``(offset in the rows, length)``, one per zstd frame; ``raw`` ``(offset in the stored
    scratch, row, plane, chunk, length)``, one per plane stored raw."""

    moves: np.ndarray
    frames: np.ndarray
    outputs: np.ndarray
    raw: np.ndarray


def step_layout(layer: PlanesZstdCodec, hosts: Sequence[np.ndarray], row_length: int, stored_row: int) -> StepLayout:
    """The layout of a step whose blocks' stored bytes are ``hosts`` (read in place, each at
    most ``stored_row`` bytes), each decoding to a row of ``row_length`` bytes (plane ``p`` of
    chunk ``c`` at ``p`` planes + the chunk's start / ``elem``): every table and frame header
    read and checked at once per block (``plane_table``, ``check_frames``), what the CPU decoder
    would refuse refused the same way (``CodecError``), no Python call per frame."""
    elem = layer.elem
    plane_length = row_length // elem
    moves, frames, outputs, raws = [], [], [], []
    for row, host in enumerate(hosts):
        if len(host) > stored_row:
            raise CodecError(layer.name, f"{len(host)} stored bytes for a {row_length}-byte payload")
        table = layer.plane_table(host, row_length)
        base = row * stored_row
        into = row * row_length + np.arange(elem) * plane_length + (table.starts // elem)[:, None]
        expected = np.broadcast_to(table.plane_lengths[:, None], table.lengths.shape)
        coded = table.lengths != expected
        layer.check_frames(host, table.positions[coded], table.lengths[coded], expected[coded])
        moves.append([[row, 0, 0, base, len(host)]])
        frames.append(np.stack([base + table.positions[coded], table.lengths[coded]], axis=1))
        outputs.append(np.stack([into[coded], expected[coded]], axis=1))
        chunk, plane = np.nonzero(~coded)
        raws.append(np.stack([base + table.positions[~coded], np.full_like(chunk, row), plane, chunk,
                              table.lengths[~coded]], axis=1))
    return StepLayout(*(np.concatenate(parts).reshape(-1, width).astype(np.int64)
                        for parts, width in ((moves, 5), (frames, 2), (outputs, 2), (raws, 5))))


class RawPlanes:
    """Puts a step's raw planes from the stored scratch (on the device) into its rows: those of
    whole chunks (``chunk / elem`` bytes) gathered and scattered in a few indexing kernels, in
    batches through a bounded scratch; a payload's short last chunk copied on its own."""

    BATCH_BYTES = 16 << 20

    def __init__(self, layer: PlanesZstdCodec, rows_bytes: int, device: torch.device) -> None:
        self.elem, self.plane = layer.elem, layer.chunk // layer.elem
        self.device = device
        self._scratch = torch.empty(min(rows_bytes, max(self.BATCH_BYTES, self.plane)), dtype=torch.uint8,
                                    device=device)

    def place(self, stored: torch.Tensor, rows: torch.Tensor, raw: np.ndarray) -> object:
        """``raw`` (``StepLayout.raw``) from ``stored`` into ``rows`` (``count`` x row length),
        queued on the current stream; returns what must live until the stream passes it."""
        count, row_length = rows.shape
        plane_length = row_length // self.elem
        whole = raw[:, 4] == self.plane
        for at, row, plane, chunk, length in raw[~whole].tolist():  # a block's short last chunk: elem at most
            into = row * row_length + plane * plane_length + chunk * self.plane
            rows.view(-1)[into:into + length].copy_(stored[at:at + length])
        if not whole.any():
            return None
        chunks = plane_length // self.plane
        grid = rows.view(count, self.elem, plane_length)[:, :, :chunks * self.plane]
        grid = grid.unflatten(2, (chunks, self.plane))  # [row, plane, chunk]: a whole chunk's plane
        windows = stored.as_strided((stored.numel() - self.plane + 1, self.plane), (1, 1))
        host = torch.from_numpy(np.ascontiguousarray(raw[whole, :4].T))
        host = host.pin_memory() if self.device.type == "cuda" else host  # lives until the stream passes it
        index = host.to(self.device, non_blocking=True)
        batch = self._scratch.numel() // self.plane  # >= 1: whole planes lie in the rows
        for first in range(0, index.shape[1], batch):
            part = index[:, first:first + batch]
            gathered = self._scratch[:part.shape[1] * self.plane].view(-1, self.plane)
            torch.index_select(windows, 0, part[0], out=gathered)
            grid.index_put_((part[1], part[2], part[3]), gathered)
        return host, index


class DevicePlanesZstd(DeviceZstdFrames):
    """Decodes ``planes-zstd`` loads on the KV's device with ``frames`` (rows: a block's planes)."""

    name = "planes-zstd"
    encodes = False

    def __init__(self, codec: PlanesZstdCodec, copier: TorchCopier, largest_payload: int,
                 frames: FrameDecoder | None = None, *, checked: bool = True, authenticated: bool = False,
                 streams: bool | None = None, step_blocks: int | None = None) -> None:
        if codec.elem != 2:
            raise InputError(f"codec planes-zstd decodes on the GPU 2-byte values only, not {codec.elem}-byte")
        super().__init__(codec.params, codec, copier, largest_payload, largest_payload, frames, checked=checked,
                         authenticated=authenticated, streams=streams, step_blocks=step_blocks)
        self.codec = codec

    def raw_refusal(self, params: str, raw_length: int) -> str | None:
        return super().raw_refusal(params, raw_length) or whole_groups_refusal(raw_length, 1)  # whole values

    def _row_length(self, raw: int) -> int:
        return raw

    def _from_rows(self, rows: torch.Tensor, payloads: torch.Tensor) -> torch.Tensor:
        count, raw = payloads.shape
        values = payloads.view(count, raw // 2, 2)
        values.copy_(rows.view(count, 2, raw // 2).transpose(1, 2))  # byte b from plane b
        return torch.zeros(count, dtype=torch.bool, device=self.device)
