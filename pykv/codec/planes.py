"""Byte planes: the bytes of ``elem``-byte values regrouped by their position in the value.

For little-endian bf16 the high byte (plane 1) holds the sign and the top 7 exponent bits,
the low byte (plane 0) the last exponent bit and the 7 mantissa bits; for fp16 the high
byte holds the sign, the 5 exponent bits and the top 2 mantissa bits. KV values cluster in
a few binades, so the high plane compresses well while the low plane is close to random:
planes let an entropy coder see each apart. numpy ufuncs release the GIL, so chunks split
and merge on several threads at once.
"""

from __future__ import annotations

import numpy as np


def split(values: memoryview, elem: int) -> list[np.ndarray]:
    """The ``elem`` planes of ``values`` (a length that is a multiple of ``elem``), plane ``i``
    holding byte ``i`` of every value, each a new contiguous array."""
    grid = np.frombuffer(values, dtype=np.uint8).reshape(-1, elem)
    return [np.ascontiguousarray(grid[:, i]) for i in range(elem)]


def merge_plane(dst: np.ndarray, plane: int, elem: int, data: np.ndarray | memoryview) -> None:
    """Write ``data`` (one byte per value) as byte ``plane`` of every ``elem``-byte value in
    ``dst`` (a writable uint8 array of ``len(data) * elem`` bytes)."""
    source = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    dst.reshape(-1, elem)[:, plane] = source
