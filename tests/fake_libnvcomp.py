"""A stand-in for ``libnvcomp.so.6``'s batched zstd C API over host memory (the tests run on the
CPU): each frame is decoded by zstandard into its output buffer at the addresses in the device
table, its decoded length and status written where nvCOMP writes them."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import zstandard


def _array(address: int, count: int, ctype=ctypes.c_int64) -> np.ndarray:
    return np.ctypeslib.as_array((ctype * count).from_address(address))


def fake_library(*, version: int = 6000, alignments: tuple[int, int, int] = (1, 1, 8), lenient: bool = False,
                 overrun: bool = False, calls: list | None = None) -> types.SimpleNamespace:
    """``lenient``: a frame that does not decode to what its header declares (a lying frame)
    reports its buffer's length and success, its bytes unwritten (a decoder that trusts the
    header); ``overrun``: such a frame writes 4 KiB past its buffer. ``calls`` gets each decode's
    frame count."""

    def properties(ref):
        ref._obj.version, ref._obj.cudart_version = version, 13040
        return 0

    def required(opts, ref):
        ref._obj.input, ref._obj.output, ref._obj.temp = alignments
        return 0

    def temp_size(count, largest, opts, ref, total, stream):
        ref._obj.value = 64 * count + 1
        return 0

    def decompress(sources, stored, buffers, decoded, count, temp, temp_bytes, outputs, opts, statuses, stream):
        if calls is not None:
            calls.append(count)
        sources, stored, buffers = _array(sources, count), _array(stored, count), _array(buffers, count)
        outputs, decoded, statuses = _array(outputs, count), _array(decoded, count), _array(statuses, count, ctypes.c_int32)
        for i in range(count):
            try:
                values = zstandard.ZstdDecompressor().decompressobj().decompress(
                    ctypes.string_at(int(sources[i]), int(stored[i])))
            except zstandard.ZstdError:
                if overrun:
                    ctypes.memset(int(outputs[i]), 7, int(buffers[i]) + 4096)
                decoded[i], statuses[i] = (buffers[i], 0) if lenient else (0, 11)
                continue
            if len(values) > buffers[i]:
                decoded[i], statuses[i] = 0, 11
                continue
            ctypes.memmove(int(outputs[i]), values, len(values))
            decoded[i], statuses[i] = len(values), 0
        return 0

    return types.SimpleNamespace(nvcompGetProperties=properties, nvcompBatchedZstdDecompressGetRequiredAlignments=required,
                                 nvcompBatchedZstdDecompressGetTempSize=temp_size,
                                 nvcompBatchedZstdDecompressAsync=decompress)


def install(monkeypatch, library) -> None:
    """``nvidia.libnvcomp`` importable, its ``load_library`` giving ``library``."""
    module = types.ModuleType("nvidia.libnvcomp")
    module.load_library = lambda: library
    package = sys.modules.get("nvidia") or types.ModuleType("nvidia")
    monkeypatch.setattr(package, "libnvcomp", module, raising=False)
    monkeypatch.setitem(sys.modules, "nvidia", package)
    monkeypatch.setitem(sys.modules, "nvidia.libnvcomp", module)
