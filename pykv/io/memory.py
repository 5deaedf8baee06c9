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


HUGE_PAGE = 2 << 20
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not in Python 3.11's mmap module


def aligned_buffer(size: int, *, populate: bool = False) -> mmap.mmap:
    """Return ``size`` bytes of zeroed, page-aligned, private anonymous memory; ``populate``:
    with every page faulted in now rather than on first touch.

    A buffer of at least one huge page asks for transparent huge pages (``MADV_HUGEPAGE``, before
    any page is faulted in; honoured where THP is ``always`` or ``madvise``, else 4 KiB pages): an
    O_DIRECT request pins its buffer page by page, and fewer, larger pages make that cheaper and
    the request fewer device segments (docs/benchmarks.md, "The reactor's per-block cost")."""
    if size <= 0:
        raise ValueError(f"buffer size must be positive, got {size}")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return mmap.mmap(-1, size, flags=flags | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0))
    buffer = mmap.mmap(-1, size, flags=flags)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled or unsupported: 4 KiB pages as before
        pass
    if populate:
        try:
            buffer.madvise(_MADV_POPULATE_WRITE)
        except OSError:  # an older kernel: touch every page
            ctypes.memset(buffer_address(buffer), 0, size)
    return buffer


def huge_page_bytes(address: int, length: int, smaps: str = "/proc/self/smaps") -> int | None:
    """Bytes of ``[address, address + length)`` on transparent huge pages now (the ``AnonHugePages``
    of the mappings it spans, from ``smaps``, at most ``length``: a mapping merged with a neighbour
    counts the neighbour's too); None where that cannot be read."""
    total, inside = 0, False
    try:
        with open(smaps, encoding="ascii", errors="replace") as lines:
            for line in lines:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):  # a mapping's first line: START-END ...
                    start, _, end = head.partition("-")
                    try:
                        inside = int(start, 16) < address + length and int(end, 16) > address
                    except ValueError:
                        inside = False
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return min(total, length)


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
