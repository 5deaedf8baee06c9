"""JobLedger: the worker's job accounting and failure routing, pure (no vLLM, no torch, no I/O)."""

from __future__ import annotations

import errno

import pytest

from pykv.counters import WorkerCounter as C
from pykv.failures import BlockFailure, Step
from pykv.jobledger import JobLedger, Kind

K = [bytes([i]) * 36 for i in range(4)]
CORRUPT = BlockFailure(Step.CHECK, detail="payload checksum mismatch")
MISSING = BlockFailure(Step.OPEN, errno.ENOENT)
READ = BlockFailure(Step.READ, errno.EIO)
FULL = BlockFailure(Step.WRITE, errno.ENOSPC)


@pytest.mark.parametrize("resident, routes", [
    ((True, True), [((0, 1), True)]),
    ((False, False), [((0, 1), False)]),
    ((True, False, True), [((0, 2), True), ((1,), False)]),
])
def test_a_load_is_served_from_dram_from_the_medium_or_split_in_both(resident, routes):
    ledger = JobLedger()
    parts = ledger.open_load(7, K[:len(resident)], [3] * len(resident), resident, now=0.0)
    assert [(p.indices, p.from_dram) for p in parts] == routes
    assert len({p.id for p in parts}) == len(parts)


def test_a_block_without_a_slot_is_never_resident():
    parts = JobLedger().open_load(1, K[:2], [None, 4], [True, True], now=0.0)
    assert [(p.indices, p.from_dram) for p in parts] == [((1,), True), ((0,), False)]


def test_a_split_load_ends_with_its_last_part_and_reports_failures_at_their_place():
    ledger = JobLedger()
    dram, disk = ledger.open_load(1, K[:3], [0, None, 2], [True, False, True], now=1.0)
    assert ledger.locate(disk.id, 0) == (1, 1)
    assert ledger.part_ended(dram.id, {}, 200, now=2.0) is None
    end = ledger.part_ended(disk.id, {0: MISSING}, 0, now=3.5)
    assert end.kind is Kind.LOAD and end.first_failed == 1 and end.failed_keys == [K[1]]
    assert end.bytes == 200 and end.seconds == 2.5 and ledger.open_jobs == 0
    assert ledger.counters[C.LOAD_BLOCKS_DRAM] == 2 and ledger.counters[C.LOAD_BLOCKS_FAILED_DISK] == 1


@pytest.mark.parametrize("failure, resident, quarantined", [
    (CORRUPT, False, True),  # a corrupt file: quarantined
    (CORRUPT, True, False),  # a bad DRAM slot: no file to blame
    (MISSING, False, False),
    (READ, False, False),
])
def test_load_failures_quarantine_only_a_corrupt_file(failure, resident, quarantined):
    ledger = JobLedger()
    part, = ledger.open_load(1, K[:1], [0], [resident], now=0.0)
    end = ledger.part_ended(part.id, {0: failure}, 0, now=1.0)
    assert end.quarantine == ((0,) if quarantined else ()) and end.pause is None
    assert end.failures == {0: failure}


def test_a_failed_copy_fails_its_block_without_quarantine():
    ledger = JobLedger()
    part, = ledger.open_load(1, K[:2], [None, None], [False, False], now=0.0)
    ledger.copy_failed(part.id, 1)
    end = ledger.part_ended(part.id, {}, 100, now=1.0)
    assert end.first_failed == 1 and end.failures[1].step is Step.COPY and not end.quarantine


@pytest.mark.parametrize("failure, pauses", [
    (FULL, True), (BlockFailure(Step.MKDIR, errno.EROFS), True), (BlockFailure(Step.PUBLISH, errno.EACCES), True),
    (BlockFailure(Step.FILL), False),
])
def test_a_store_the_medium_refused_pauses_stores_and_others_do_not(failure, pauses):
    ledger = JobLedger()
    part = ledger.open_store(1, K[:2], [None, 5], now=0.0)
    ledger.filled(part.id, 0, True, 10)
    ledger.filled(part.id, 1, True, 10)
    end = ledger.part_ended(part.id, {1: failure}, 10, now=1.0, published=1)
    assert (end.pause is failure) is pauses and not end.quarantine
    assert end.failed_stores == ((1, True),)  # its DRAM slot holds the block anyway
    assert ledger.counters[C.STORE_PUBLISHED] == 1 and ledger.counters[C.STORE_BLOCKS_FAILED] == 1


def test_a_store_holds_the_engine_blocks_until_copied_out_and_a_load_until_it_ends():
    ledger = JobLedger()
    store = ledger.open_store(1, K[:2], [None, None], now=0.0)
    load, = ledger.open_load(2, K[2:3], [None], [False], now=0.0)
    assert ledger.holds_engine_blocks([1]) and ledger.holds_engine_blocks([2])
    assert ledger.filled(store.id, 0, True, 10) is False
    assert ledger.filled(store.id, 1, False, 10) is True
    assert not ledger.holds_engine_blocks([1]) and ledger.holds_engine_blocks([1, 2])
    end = ledger.part_ended(store.id, {1: BlockFailure(Step.FILL)}, 10, now=1.0)
    assert end.failed_stores == ((1, False),)  # the copy failed: nothing of it anywhere
    ledger.part_ended(load.id, {}, 0, now=1.0)
    assert not ledger.holds_engine_blocks([1, 2, 99])


def sealed(ledger: JobLedger, part, n: int):
    releases = []
    for i in range(n):
        ledger.filled(part.id, i, True, 100)
        releases.append(ledger.staged(part.id, now=2.0))
    return releases


def test_early_release_once_every_block_is_sealed_in_a_dram_slot():
    ledger = JobLedger(early_release=True)
    part = ledger.open_store(1, K[:2], [4, 5], now=0.5)
    first, last = sealed(ledger, part, 2)
    assert first is None and (last.job, last.bytes, last.seconds) == (1, 200, 1.5)
    assert ledger.counters[C.STORE_JOBS_RELEASED_EARLY] == 1 and ledger.open_jobs == 1  # the writes go on
    end = ledger.part_ended(part.id, {}, 200, now=3.0, published=2)
    assert end.released and end.stores_ended == (0, 1)


@pytest.mark.parametrize("early, slots, copy_fails", [(False, [4, 5], False), (True, [4, None], False),
                                                      (True, [4, 5], True)])
def test_no_early_release_without_it_without_all_slots_or_after_a_failed_copy(early, slots, copy_fails):
    ledger = JobLedger(early_release=early)
    part = ledger.open_store(1, K[:2], slots, now=0.0)
    if copy_fails:
        ledger.copy_failed(part.id, 0)
    assert sealed(ledger, part, 2) == [None, None]
    end = ledger.part_ended(part.id, {}, 200, now=1.0)
    assert not end.released
    assert end.stores_ended == (tuple(i for i, s in enumerate(slots) if s is not None) if early else ())


def test_load_jobs_count_their_wall_time_and_bytes_from_dram_and_disk():
    ledger = JobLedger()
    dram, = ledger.open_load(1, K[:1], [0], [True], now=10.0)
    ledger.part_ended(dram.id, {}, 4096, now=10.25)
    disk, = ledger.open_load(2, K[1:3], [None, None], [False, False], now=11.0)
    ledger.part_ended(disk.id, {}, 8192, now=12.0)
    assert ledger.counters[C.LOAD_JOBS] == 2
    assert ledger.counters[C.LOAD_JOB_US] == 1_250_000 and ledger.counters[C.LOAD_JOB_MAX_US] == 1_000_000
    assert ledger.counters[C.LOAD_JOB_BYTES] == 12288


def test_a_job_id_is_open_once():
    ledger = JobLedger()
    ledger.open_store(1, K[:1], [None], now=0.0)
    with pytest.raises(ValueError):
        ledger.open_load(1, K[:1], [None], [False], now=0.0)


def test_a_store_opened_with_unstored_blocks_writes_the_others_and_reports_them_failed_at_once():
    ledger = JobLedger(early_release=True)
    lookup = BlockFailure(Step.STALL, detail="its device did not answer within lookup_deadline")
    part = ledger.open_store(5, K[:4], [0, 1, None, 3], now=0.0, unstored={1: lookup, 2: lookup})
    assert part.indices == (0, 3) and ledger.locate(part.id, 1) == (5, 3)
    assert ledger.holds_engine_blocks([5])
    ledger.filled(part.id, 0, True, 10)
    assert ledger.filled(part.id, 1, True, 10) and not ledger.holds_engine_blocks([5])
    end = ledger.part_ended(part.id, {}, 20, now=1.0, published=2)
    assert end.failures == {1: lookup, 2: lookup} and end.failed_stores == ((1, False), (2, False))
    assert end.pause is None and end.stores_ended == (0, 1, 3)  # every DRAM slot of this rank is free again
    every = ledger.open_store(6, K[:2], [None, None], now=0.0, unstored={0: lookup, 1: lookup})
    assert every.indices == () and not ledger.holds_engine_blocks([6])


def test_blocks_of_a_load_that_are_not_read_fail_at_their_place_in_the_job():
    ledger = JobLedger()
    dram, disk = ledger.open_load(8, K[:4], [0, None, None, None], [True, False, False, False], now=0.0)
    ledger.unread(disk.id, {1: MISSING, 2: MISSING})
    ledger.part_ended(dram.id, {}, 10, now=0.5)
    end = ledger.part_ended(disk.id, {}, 10, now=1.0)
    assert end.failures == {2: MISSING, 3: MISSING} and end.first_failed == 2 and end.quarantine == ()
    assert ledger.counters[C.LOAD_BLOCKS_FAILED_DISK] == 2 and ledger.counters[C.LOAD_BLOCKS_DISK] == 1
