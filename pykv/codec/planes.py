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

WORDS = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}
"""Little-endian unsigned words of each value size: byte ``i`` of a value is ``word >> 8 i``
(shifts run at memory speed; gathering every other byte with a strided copy is ~10x slower)."""


def split(values: memoryview, elem: int) -> list[np.ndarray]:
    """The ``elem`` planes of ``values`` (a length that is a multiple of ``elem``), plane ``i``
    holding byte ``i`` of every value, each a new contiguous array."""
    words = np.frombuffer(values, dtype=WORDS[elem])
    return [(words >> (8 * i)).astype(np.uint8) if i else words.astype(np.uint8) for i in range(elem)]


def merge(dst: np.ndarray, planes: list[np.ndarray], elem: int) -> None:
    """Interleave ``planes`` (one byte per value each, plane ``i`` = byte ``i``) into ``dst``, a
    writable uint8 array of ``len(planes[0]) * elem`` bytes. The top plane is widened and shifted
    straight into ``dst`` and the low one OR-ed in place: two passes and no temporary for 2-byte
    values."""
    word = WORDS[elem]
    words = dst.view(word)
    if elem == 1:
        np.copyto(words, planes[0])
        return
    np.left_shift(planes[elem - 1], 8 * (elem - 1), dtype=word, out=words)
    for i in range(elem - 2, 0, -1):
        words |= np.left_shift(planes[i], 8 * i, dtype=word)
    np.bitwise_or(words, planes[0], out=words)
