"""The staging pool and its slot ledger (pykv/staging.py)."""

from __future__ import annotations

import threading

import pytest

from pykv.format import HEADER_SIZE
from pykv.staging import StagingPool, SlotLedger, slot_bytes_for

# -- SlotLedger --------------------------------------------------------------------------------

def test_acquire_until_exhausted_then_none():
    ledger = SlotLedger(3)
    slots = [ledger.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2]
    assert ledger.free == 0
    assert ledger.acquire() is None
    assert ledger.acquire() is None
    assert all(ledger.refs(s) == 1 for s in slots)


def test_release_returns_the_slot_to_the_free_list():
    ledger = SlotLedger(2)
    a, b = ledger.acquire(), ledger.acquire()
    assert ledger.acquire() is None
    assert ledger.release(a) is True
    assert ledger.free == 1
    assert ledger.refs(a) == 0
    assert ledger.acquire() == a
    assert ledger.refs(b) == 1


def test_retain_and_release_count_references():
    ledger = SlotLedger(1)
    slot = ledger.acquire()
    ledger.retain(slot)
    ledger.retain(slot)
    assert ledger.refs(slot) == 3
    assert ledger.release(slot) is False
    assert ledger.release(slot) is False
    assert ledger.free == 0
    assert ledger.acquire() is None
    assert ledger.release(slot) is True
    assert ledger.free == 1
    assert ledger.acquire() == slot


def test_double_release_raises():
    ledger = SlotLedger(2)
    slot = ledger.acquire()
    ledger.release(slot)
    with pytest.raises(ValueError, match="released more often"):
        ledger.release(slot)
    assert ledger.free == 2  # the failed release did not add it twice


def test_release_of_never_acquired_slot_raises():
    ledger = SlotLedger(2)
    with pytest.raises(ValueError):
        ledger.release(1)


def test_retain_of_free_slot_raises():
    ledger = SlotLedger(2)
    with pytest.raises(ValueError, match="not held"):
        ledger.retain(0)
    assert ledger.refs(0) == 0


def test_ledger_needs_a_slot():
    with pytest.raises(ValueError):
        SlotLedger(0)


def test_ledger_is_thread_safe():
    ledger = SlotLedger(3)  # fewer slots than threads: they must contend
    held: set[int] = set()
    check = threading.Lock()
    problems: list[str] = []
    counts = [0] * 4
    start = threading.Barrier(4)

    def worker(index: int) -> None:
        start.wait()
        done = 0
        while done < 10_000:
            slot = ledger.acquire()
            if slot is None:
                continue
            with check:
                if slot in held:
                    problems.append(f"slot {slot} handed out twice")
                if ledger.refs(slot) != 1:
                    problems.append(f"slot {slot} acquired with refs {ledger.refs(slot)}")
                held.add(slot)
            ledger.retain(slot)
            ledger.release(slot)
            with check:
                held.discard(slot)
            ledger.release(slot)
            done += 1
        counts[index] = done

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert problems == []
    assert counts == [10_000] * 4
    assert ledger.free == 3
    assert [ledger.refs(s) for s in range(3)] == [0, 0, 0]
    assert sorted(ledger.acquire() for _ in range(3)) == [0, 1, 2]


# -- StagingPool -------------------------------------------------------------------------------

def test_slot_bytes_for():
    assert slot_bytes_for(0) == HEADER_SIZE
    assert slot_bytes_for(1) == HEADER_SIZE + 4096
    assert slot_bytes_for(6000) == HEADER_SIZE + 8192
    assert slot_bytes_for(8192) == HEADER_SIZE + 8192


def test_addresses_are_page_aligned_and_slot_bytes_apart():
    pool = StagingPool(3 * 4096, 5)
    try:
        assert pool.base_address % 4096 == 0
        for slot in range(5):
            assert pool.address(slot) % 4096 == 0
            assert pool.address(slot) == pool.base_address + slot * 3 * 4096
        assert pool.num_slots == 5
        assert pool.total_bytes == 5 * 3 * 4096
    finally:
        pool.close()


def test_views_are_sized_writable_and_distinct():
    pool = StagingPool(8192, 4)
    try:
        for slot in range(4):
            view = pool.view(slot)
            assert len(view) == 8192
            assert not view.readonly
            assert bytes(view) == bytes(8192)  # fresh memory is zero
            view[:] = bytes([slot + 1]) * 8192
        for slot in range(4):
            assert bytes(pool.view(slot)) == bytes([slot + 1]) * 8192
    finally:
        pool.close()


def test_view_memory_is_at_the_slot_address():
    import ctypes
    pool = StagingPool(4096, 3)
    try:
        pool.view(2)[:4] = b"PYKV"
        assert ctypes.string_at(pool.address(2), 4) == b"PYKV"
    finally:
        pool.close()


@pytest.mark.parametrize("slot_bytes", [0, -4096, 100, 4095, 4097, 4096 + 512])
def test_slot_bytes_not_a_page_multiple_is_rejected(slot_bytes):
    with pytest.raises(ValueError, match="multiple"):
        StagingPool(slot_bytes, 2)


def test_register_and_unregister_hooks():
    calls: list[tuple] = []
    pool = StagingPool(8192, 3, register=lambda address, length: calls.append(("register", address, length)),
                       unregister=lambda address: calls.append(("unregister", address)))
    assert calls == [("register", pool.base_address, 3 * 8192)]
    pool.close()
    assert calls == [("register", pool.base_address, 3 * 8192), ("unregister", pool.base_address)]
    pool.close()  # a second close does not unregister twice
    assert len(calls) == 2


def test_close_while_a_view_is_still_held_does_not_raise():
    pool = StagingPool(4096, 2)
    view = pool.view(0)
    pool.close()
    del view


def test_payload_view_starts_after_the_header():
    pool = StagingPool(slot_bytes_for(6000), 2)
    try:
        payload = pool.payload_view(1, 6000)
        assert len(payload) == 6000
        payload[:] = b"\xab" * 6000
        whole = pool.view(1)
        assert bytes(whole[:HEADER_SIZE]) == bytes(HEADER_SIZE)
        assert bytes(whole[HEADER_SIZE:HEADER_SIZE + 6000]) == b"\xab" * 6000
        assert bytes(whole[HEADER_SIZE + 6000:]) == bytes(len(whole) - HEADER_SIZE - 6000)
        assert bytes(pool.view(0)) == bytes(pool.slot_bytes)
    finally:
        pool.close()


def test_pool_has_its_own_ledger():
    pool = StagingPool(4096, 2)
    try:
        assert pool.ledger.num_slots == 2
        assert pool.ledger.acquire() is not None
        assert pool.ledger.acquire() is not None
        assert pool.ledger.acquire() is None
    finally:
        pool.close()


def test_copy_slot_copies_the_prefix_only_and_checks_its_arguments():
    pool = StagingPool(8192, 3, reserved=1)
    pool.view(0)[:] = b"\xab" * 8192
    pool.view(2)[:] = b"\x00" * 8192
    pool.copy_slot(0, 2, 5000)  # into the reserved (DRAM-tier) slot
    assert bytes(pool.view(2)[:5000]) == b"\xab" * 5000 and bytes(pool.view(2)[5000:]) == b"\x00" * 3192
    with pytest.raises(IndexError):
        pool.copy_slot(0, 3, 10)
    with pytest.raises(ValueError):
        pool.copy_slot(0, 1, 8193)
    pool.close()


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.parametrize("populate", [False, True])
def test_a_populated_pool_is_resident_at_creation_and_a_plain_one_on_first_touch(populate):
    """Benchmarks populate their slots (as page-locking does for an engine's), so that timed reads
    into them do not pay first-touch page faults; a plain pool takes memory only where touched."""
    size = 64 << 20
    before = resident_bytes()
    pool = StagingPool(4 << 20, size // (4 << 20), populate=populate)
    try:
        grown = resident_bytes() - before
        assert grown >= size * 0.9 if populate else grown < size * 0.25
        pool.view(0)[:] = b"\x01" * (4 << 20)  # both are usable memory
        assert bytes(pool.view(0)[:2]) == b"\x01\x01"
    finally:
        pool.close()
