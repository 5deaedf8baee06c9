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


_FIELD_MASKS = np.array([[byte < size for byte in range(8)] for size in range(9)])
"""Row ``n``: the first ``n`` of a content size field's 8 gathered bytes are its own."""


def declared_sizes(stored: np.ndarray, positions: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The content size declared by each frame of ``lengths[i]`` bytes at ``positions[i]`` of the
    uint8 array ``stored`` (frames inside it: the caller's table says so), or -1 (int64)."""
    positions = np.asarray(positions, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if positions.size == 0 or len(stored) == 0:
        return np.full(positions.size, -1, dtype=np.int64)
    last = len(stored) - 1  # bytes past a frame's end are read only where its header cannot fit
    head = stored[np.minimum(positions[:, None] + np.arange(HEADER_MAX), last)]
    magic = np.ascontiguousarray(head[:, :4]).view("<u4")[:, 0]
    descriptor = head[:, 4].astype(np.int64)
    single = (descriptor >> 5) & 1
    size_bytes = np.where(descriptor >> 6 == 0, single, 1 << (descriptor >> 6))
    start = 6 - single  # after the window byte, absent in a single-segment frame
    sound = ((magic == MAGIC) & (descriptor & 0x0B == 0) & (size_bytes > 0) & (lengths >= start + size_bytes)
             & ((single == 1) | ((head[:, 5] >> 3) + 10 <= WINDOW_LOG_MAX)))
    field = np.take_along_axis(head, start[:, None] + np.arange(8), axis=1) * _FIELD_MASKS[size_bytes]
    value = field.view("<u8")[:, 0] + np.where(size_bytes == 2, 256, 0).astype(np.uint64)
    sound &= value < np.uint64(1 << 62)
    return np.where(sound, value.astype(np.int64), -1)
