"""The content sizes that many zstd frame headers declare, read at once (numpy, no call per frame).

A frame header (RFC 8878, 3.1.1): the magic number (4 bytes), a descriptor byte, a window
byte unless the frame is single-segment, a dictionary id (0-4 bytes) and the content size
(0, 1, 2, 4 or 8 bytes; the 2-byte field stores the size less 256). Only headers that a frame
pykv's encoder writes could have are read: no dictionary, the reserved bit clear, the content
size present, a window that zstd's decoder accepts by default; any other gives -1, as does a
header longer than its frame. Stricter than ``zstandard.frame_content_size``, never laxer: a
size read here is the size zstd reads.
"""

from __future__ import annotations

import numpy as np

MAGIC = 0xFD2FB528
HEADER_MAX = 18
"""Bytes of the longest header: magic 4, descriptor 1, window 1, dictionary id 4, content size 8."""
WINDOW_LOG_MAX = 27
"""The largest window (log2 bytes) zstd's decoder accepts unless told otherwise."""


def declared_sizes(stored: np.ndarray, positions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The content size declared by each frame of ``lengths[i]`` bytes at ``positions[i]`` of the
    uint8 array ``stored`` (frames inside it: the caller's table says so), or -1 (int64)."""
    positions = np.asarray(positions, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if positions.size == 0:
        return np.empty(0, dtype=np.int64)
    offsets = np.arange(HEADER_MAX)
    inside = offsets < lengths[:, None]
    at = np.minimum(positions[:, None] + offsets, max(len(stored) - 1, 0))
    head = np.where(inside, stored[at] if len(stored) else 0, 0).astype(np.uint64)
    magic = head[:, 0] | head[:, 1] << 8 | head[:, 2] << 16 | head[:, 3] << 24
    descriptor = head[:, 4]
    single = (descriptor >> 5) & 1
    size_bytes = np.where(descriptor >> 6 == 0, single, np.uint64(1) << (descriptor >> 6)).astype(np.int64)
    start = 6 - single.astype(np.int64)  # after the window byte, absent in a single-segment frame
    window_log = (head[:, 5] >> 3) + 10
    sound = ((magic == MAGIC) & (descriptor & 0x0B == 0) & (size_bytes > 0) & (lengths >= start + size_bytes)
             & ((single == 1) | (window_log <= WINDOW_LOG_MAX)))
    columns = np.minimum(start[:, None] + np.arange(8), HEADER_MAX - 1)
    field = np.take_along_axis(head, columns, axis=1)
    field = np.where(np.arange(8) < size_bytes[:, None], field, 0)
    value = np.zeros(len(positions), dtype=np.uint64)
    for byte in range(8):
        value |= field[:, byte] << np.uint64(8 * byte)
    value = value + np.where(size_bytes == 2, np.uint64(256), np.uint64(0))
    sound &= value < np.uint64(1 << 62)
    return np.where(sound, value.astype(np.int64), -1)
