"""nvCOMP's batched zstd decoder called through its C API (``libnvcomp.so.6``, shipped in the
``nvidia-libnvcomp-cu12``/``-cu13`` wheel that ``nvidia-nvcomp`` depends on).

A step's frames go to the device as one table (source addresses, stored lengths, output
lengths, output addresses: one page-locked copy), so a step costs a few torch calls and one
C call whatever its frame count; the Python API (``zstd_frames.NvcompFrames``'s other modes)
builds an object per frame. nvCOMP reports each frame's decoded length and status on the
device: a frame that decodes to any other length than its output's, or fails, sets the step's
bad flag. nvCOMP 6.0 writes all of a frame holding more bytes than its header declares, past
its output (H100, run 28), so the start check (``device_zstd.DeviceZstdFrames.self_test``)
keeps this mode only with a MAC over the stored bytes, as it does the Python API's fast modes."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from pykv.codec.base import CodecError

MAJOR = 6
"""The C API's version these signatures are nvCOMP 6's (``nvcompGetProperties``)."""
_SIZE = ctypes.c_size_t
_STATUS = ctypes.c_int


class _DecompressOpts(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]  # backend 0: nvCOMP's choice


class _Alignments(ctypes.Structure):
    _fields_ = [("input", _SIZE), ("output", _SIZE), ("temp", _SIZE)]


class _Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


class NvcompUnavailable(Exception):
    """libnvcomp's C API is missing or of another major version than this binding's."""


def load_library() -> ctypes.CDLL:
    """libnvcomp as the ``nvidia-libnvcomp`` wheel loads it, its zstd decoder's signatures
    declared. ``NvcompUnavailable`` where it is not installed or not nvCOMP 6."""
    try:
        from nvidia.libnvcomp import load_library as wheel_library
        lib = wheel_library()
    except Exception as exc:  # noqa: BLE001 - not installed, or its loader fails: no C API
        raise NvcompUnavailable(f"nvidia-libnvcomp does not load: {type(exc).__name__}: {exc}") from None
    if lib is None:
        raise NvcompUnavailable("nvidia-libnvcomp found no libnvcomp.so.6")
    try:
        properties = _Properties()
        lib.nvcompGetProperties.argtypes = [ctypes.POINTER(_Properties)]
        lib.nvcompGetProperties.restype = _STATUS
        if lib.nvcompGetProperties(ctypes.byref(properties)) != 0 or properties.version // 1000 != MAJOR:
            raise NvcompUnavailable(f"libnvcomp version {properties.version}, this binding is for {MAJOR}.x")
        lib.nvcompBatchedZstdDecompressGetRequiredAlignments.argtypes = [_DecompressOpts, ctypes.POINTER(_Alignments)]
        lib.nvcompBatchedZstdDecompressGetTempSize.argtypes = [
            _SIZE, _SIZE, _DecompressOpts, ctypes.POINTER(_SIZE), _SIZE, ctypes.c_void_p]
        lib.nvcompBatchedZstdDecompressAsync.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _SIZE, ctypes.c_void_p, _SIZE,
            ctypes.c_void_p, _DecompressOpts, ctypes.c_void_p, ctypes.c_void_p]
        for name in ("nvcompBatchedZstdDecompressGetRequiredAlignments", "nvcompBatchedZstdDecompressGetTempSize",
                     "nvcompBatchedZstdDecompressAsync"):
            getattr(lib, name).restype = _STATUS
    except AttributeError as exc:
        raise NvcompUnavailable(f"libnvcomp lacks {exc}") from None
    return lib


class BatchedZstd:
    """Decodes a step's zstd frames with one ``nvcompBatchedZstdDecompressAsync`` on the current
    stream (``FrameDecoder``). ``lib``: ``load_library()``'s (tests pass a fake)."""

    def __init__(self, device: torch.device, lib: ctypes.CDLL | None = None) -> None:
        self.device = device
        self._lib = lib if lib is not None else load_library()
        self._opts = _DecompressOpts()
        alignments = _Alignments()
        self._check(self._lib.nvcompBatchedZstdDecompressGetRequiredAlignments(self._opts, ctypes.byref(alignments)),
                    "alignments")
        if alignments.input > 1 or alignments.output > 1:  # frames and planes lie at any byte
            raise NvcompUnavailable(f"nvCOMP's zstd decoder wants frames aligned to {alignments.input} and outputs "
                                    f"to {alignments.output} bytes")
        self._temp_alignment = max(1, alignments.temp)
        self._temp = torch.empty(0, dtype=torch.uint8, device=device)
        self._capacity = 0
        self._lock = threading.Lock()  # one step at a time uses the device tables

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise CodecError("zstd", f"nvCOMP's batched zstd {what} failed (status {status})")

    def reserve(self, count: int, largest: int, total: int) -> None:
        """The tables and nvCOMP's scratch for a step of ``count`` frames of at most ``largest``
        and ``total`` decoded bytes, taken now (a torch out-of-memory error where they do not fit)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        with self._lock:
            self._reserve(count, largest, total, stream)

    def _reserve(self, count: int, largest: int, total: int, stream: int) -> None:
        if count > self._capacity:
            self._capacity = max(count, 2 * self._capacity)
            self._table = torch.empty(4 * self._capacity, dtype=torch.int64, device=self.device)
            self._decoded = torch.empty(self._capacity, dtype=torch.int64, device=self.device)
            self._statuses = torch.empty(self._capacity, dtype=torch.int32, device=self.device)
        needed = _SIZE()
        self._check(self._lib.nvcompBatchedZstdDecompressGetTempSize(count, largest, self._opts, ctypes.byref(needed),
                                                                     total, stream), "temp size")
        if needed.value + self._temp_alignment > self._temp.numel():
            self._temp = torch.empty(needed.value + self._temp_alignment, dtype=torch.uint8, device=self.device)

    def decode(self, source: torch.Tensor, frames: np.ndarray, target: torch.Tensor,
               outputs: np.ndarray) -> tuple[torch.Tensor, object]:
        count = len(frames)
        if count == 0:
            return torch.zeros((), dtype=torch.bool, device=target.device), None
        if frames[:, 0].min() < 0 or (frames.sum(axis=1).max() > source.numel() or
                                      outputs[:, 0].min() < 0 or outputs.sum(axis=1).max() > target.numel()):
            raise CodecError("zstd", "a frame or its output lies outside the step's buffers")
        table = np.empty((4, count), dtype=np.int64)
        table[0] = source.data_ptr() + frames[:, 0]
        table[1] = frames[:, 1]
        table[2] = outputs[:, 1]
        table[3] = target.data_ptr() + outputs[:, 0]
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        with self._lock:
            self._reserve(count, int(table[2].max()), int(table[2].sum()), stream)
            host = torch.from_numpy(table).pin_memory() if self.device.type == "cuda" else torch.from_numpy(table)
            device_table = self._table[:4 * count].view(4, count)  # contiguous: one plain copy
            device_table.copy_(host, non_blocking=True)  # the page-locked copy lives until the stream passes it
            temp_at = -self._temp.data_ptr() % self._temp_alignment
            temp = self._temp[temp_at:]
            self._check(self._lib.nvcompBatchedZstdDecompressAsync(
                device_table[0].data_ptr(), device_table[1].data_ptr(), device_table[2].data_ptr(),
                self._decoded.data_ptr(), count, temp.data_ptr(), temp.numel(), device_table[3].data_ptr(),
                self._opts, self._statuses.data_ptr(), stream), "decode")
            bad = (self._decoded[:count] != device_table[2]).any() | (self._statuses[:count] != 0).any()
        return bad, host
