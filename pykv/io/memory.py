"""Page-aligned host memory for O_DIRECT transfers, addressed by raw pointers.

O_DIRECT needs the buffer address, the file offset and the length aligned
(4096 covers 512-byte and 4 KiB sector devices). ``bytearray`` and plain torch
CPU tensors start a few bytes into a page, so use anonymous ``mmap`` memory (or
pinned tensors, which come back page-aligned).
"""

from __future__ import annotations

import ctypes
import mmap

ALIGNMENT = 4096
"""Alignment used for O_DIRECT addresses, offsets and lengths."""


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    """Round ``value`` up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & ~(alignment - 1)


def aligned_buffer(size: int, *, populate: bool = False) -> mmap.mmap:
    """Return ``size`` bytes of zeroed, page-aligned, private anonymous memory; ``populate``:
    with every page faulted in now (``MAP_POPULATE``) rather than on first touch."""
    if size <= 0:
        raise ValueError(f"buffer size must be positive, got {size}")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(-1, size, flags=flags)


def buffer_address(buffer: mmap.mmap) -> int:
    """Return the address of ``buffer``'s first byte.

    The address stays valid while ``buffer`` is open; the caller keeps it alive
    for as long as operations use the address.
    """
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # release the buffer export so the mmap can still be closed
