"""The bounded staging pool: one contiguous, page-aligned allocation cut into fixed slots.

Every load, store and preload moves through a slot; a slot holds one storage
block file (4 KiB header + padded payload), so disk I/O and host<->device copies
use the same bytes with no extra copy. Slots are reference counted: the reactor
takes a slot for a transfer, a DRAM-tier entry or a second reader may retain it,
and it returns to the free list when the last holder releases it. Nothing is
allocated after construction.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
from typing import Callable

from pykv.format import HEADER_SIZE, padded
from pykv.io.memory import aligned_buffer, buffer_address, huge_page_bytes

PAGE = mmap.PAGESIZE


def slot_bytes_for(payload_length: int) -> int:
    """Slot size that fits one storage block file with ``payload_length`` payload bytes."""
    return HEADER_SIZE + padded(payload_length)


class SlotLedger:
    """Pure accounting of slots: a free list and reference counts. Thread-safe.

    The last ``reserved`` slots are never handed out: their owner (the DRAM tier)
    assigns them itself.
    """

    def __init__(self, num_slots: int, reserved: int = 0) -> None:
        if num_slots - reserved <= 0 or reserved < 0:
            raise ValueError("a staging pool needs at least one slot outside the reserved ones")
        self.num_slots = num_slots
        self.reserved = reserved
        self._free: collections.deque[int] = collections.deque(range(num_slots - reserved))
        self._refs = [0] * num_slots
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        """Slots nobody holds."""
        return len(self._free)

    def acquire(self) -> int | None:
        """Take a free slot (reference count 1), or None when all are held."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.popleft()
            self._refs[slot] = 1
            return slot

    def check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")

    def retain(self, slot: int) -> None:
        """Add a holder to a held slot."""
        self.check(slot)
        with self._lock:
            if self._refs[slot] <= 0:
                raise ValueError(f"slot {slot} is not held")
            self._refs[slot] += 1

    def release(self, slot: int) -> bool:
        """Drop one holder; True when the slot became free."""
        self.check(slot)
        with self._lock:
            if self._refs[slot] <= 0:
                raise ValueError(f"slot {slot} released more often than taken")
            self._refs[slot] -= 1
            if self._refs[slot]:
                return False
            self._free.append(slot)
            return True

    def refs(self, slot: int) -> int:
        return self._refs[slot]


class StagingPool:
    """``num_slots`` slots of ``slot_bytes`` each in one page-aligned region.

    The last ``reserved`` slots stay outside the ledger (see ``SlotLedger``).

    ``register`` (optional) is called once with (address, length) to page-lock
    the region for DMA (the connector passes ``cudaHostRegister`` when CUDA is
    present); ``unregister`` is called on ``close``. ``populate``: fault every page
    in at creation (as page-locking does), so that timed transfers into the slots
    do not pay first-touch page faults (the benchmarks).
    """

    def __init__(self, slot_bytes: int, num_slots: int, *, reserved: int = 0,
                 register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None, populate: bool = False) -> None:
        if slot_bytes <= 0 or slot_bytes % PAGE:
            raise ValueError(f"slot_bytes must be a positive multiple of {PAGE}, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.ledger = SlotLedger(num_slots, reserved)
        self._memory = aligned_buffer(slot_bytes * num_slots, populate=populate)
        self._view = memoryview(self._memory)
        self.base_address = buffer_address(self._memory)
        self._unregister = unregister
        if register is not None:
            register(self.base_address, len(self._memory))

    @property
    def num_slots(self) -> int:
        return self.ledger.num_slots

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def huge_bytes(self) -> int | None:
        """Bytes of the pool's memory on transparent huge pages now (None where unknown)."""
        return huge_page_bytes(self.base_address, len(self._memory))

    def address(self, slot: int) -> int:
        """Raw pointer to the first byte of ``slot`` (page aligned)."""
        return self.base_address + slot * self.slot_bytes

    def copy_slot(self, source: int, destination: int, length: int) -> None:
        """Copy the first ``length`` bytes of slot ``source`` into slot ``destination``.

        ``ctypes.memmove`` drops the GIL for the copy (tens of MB), so the engine thread runs on.
        """
        self.ledger.check(source)
        self.ledger.check(destination)
        if not 0 <= length <= self.slot_bytes:
            raise ValueError(f"length {length} outside 0..{self.slot_bytes}")
        if source != destination:
            ctypes.memmove(self.address(destination), self.address(source), length)

    def view(self, slot: int) -> memoryview:
        """The whole slot (header then payload)."""
        self.ledger.check(slot)
        start = slot * self.slot_bytes
        return self._view[start:start + self.slot_bytes]

    def payload_view(self, slot: int, length: int) -> memoryview:
        """The payload part of ``slot``: ``length`` bytes after the 4 KiB header."""
        self.ledger.check(slot)
        if not 0 <= length <= self.slot_bytes - HEADER_SIZE:
            raise ValueError(f"payload of {length} bytes does not fit a slot of {self.slot_bytes}")
        start = slot * self.slot_bytes + HEADER_SIZE
        return self._view[start:start + length]

    def close(self) -> None:
        """Free the region (all slots must have been released)."""
        if self._unregister is not None:
            self._unregister(self.base_address)
            self._unregister = None
        self._view.release()
        try:
            self._memory.close()
        except BufferError:  # a caller still holds a view; the mapping dies with it
            pass
