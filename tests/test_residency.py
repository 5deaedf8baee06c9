"""DramResidency and StorePause: the scheduler's DRAM-slot ledger, pure (no vLLM, no torch, no I/O)."""

from __future__ import annotations

import copy
import itertools

import pytest

from pykv.residency import DramResidency, StorePause, Tier

A, B, C = b"a" * 36, b"b" * 36, b"c" * 36


def stored(residency: DramResidency, *keys: bytes) -> list[int]:
    slots = [residency.begin_store(k) for k in keys]
    residency.store_completed(keys)
    return slots


def test_a_completed_store_is_a_hit_and_its_slot_unpinned_without_early_release():
    r = DramResidency(2)
    assert r.holds(A) is False
    slot = r.begin_store(A)
    assert slot is not None and r.holds(A) and r.slot_of(A) is None  # pending: not a hit yet
    r.store_completed([A])
    assert r.slot_of(A) == slot and r.index.entry(A).pins == 0 and r.pending_stores == 0


def test_a_dram_hit_is_pinned_until_its_load_ends():
    r = DramResidency(2)
    slot, = stored(r, A)
    assert r.pin_hit(A) == slot and r.index.entry(A).pins == 1
    assert r.pin_hit(B) is None
    r.loads_ended([A])
    assert r.index.entry(A).pins == 0 and r.slot_of(A) == slot


def test_a_promotion_is_pinned_and_becomes_a_hit_when_its_load_ends_unless_it_failed():
    r = DramResidency(2)
    slot = r.promotion_slot(A)
    assert slot is not None and r.slot_of(A) is None and r.index.entry(A).pins == 1
    assert r.promotion_slot(A) is None  # already has an entry
    r.loads_ended([A])
    assert r.slot_of(A) == slot and r.index.entry(A).pins == 0
    r.promotion_slot(B)
    r.load_failed(B)
    r.loads_ended([B])
    assert r.slot_of(B) is None and B not in r.index
    assert DramResidency(0).promotion_slot(A) is None


def test_early_release_keeps_the_slot_pinned_until_the_write_ends():
    r = DramResidency(2, early_release=True)
    slot, = stored(r, A)
    assert r.slot_of(A) == slot and r.index.entry(A).pins == 1 and set(r.writes()) == {A}
    r.write_ended(A)
    assert r.index.entry(A).pins == 0 and not r.writes() and r.slot_of(A) == slot


def test_a_write_that_ends_before_the_store_completes_unpins_at_completion():
    r = DramResidency(2, early_release=True)
    r.begin_store(A)
    r.write_ended(A)
    assert not r.writes() and r.index.entry(A).pins == 1  # the engine still has the store
    r.store_completed([A])
    assert r.index.entry(A).pins == 0 and r.slot_of(A) is not None
    assert r.writes() == {}


def test_a_key_forgotten_while_written_misses_but_keeps_its_slot_until_the_write_ends():
    r = DramResidency(2, early_release=True)
    slot, = stored(r, A)
    r.load_failed(A)
    assert r.slot_of(A) is None and A in r.index  # a miss, the slot still taken
    r.loads_ended([A])  # the failed load's completion does not make it a hit again
    assert r.slot_of(A) is None
    assert r.begin_store(B) != slot and r.begin_store(C) is None  # the written slot is never handed out
    r.write_ended(A)
    assert A not in r.index and r.index.free_slots == 1


def test_a_failed_store_forgets_its_entry_unless_the_slot_holds_the_block():
    r = DramResidency(2)
    r.begin_store(A)
    r.begin_store(B)
    r.store_failed(A, dram_ok=True)
    r.store_failed(B, dram_ok=False)
    assert A in r.index and B in r.index  # B's slot stays taken while its store is in flight ...
    r.store_completed([B])
    assert B not in r.index and r.slot_of(B) is None  # ... and is never a hit
    r.store_completed([A], success=False)
    assert A not in r.index and r.pending_stores == 0 and r.index.free_slots == 2


def test_a_cache_reset_keeps_slots_in_flight_taken_until_flushed_and_written():
    r = DramResidency(3, early_release=True)
    stored(r, A)  # written from its slot still
    r.begin_store(B)  # a store in flight
    stored(r, C)
    r.write_ended(C)  # idle: forgotten at once
    r.reset()
    assert all(r.slot_of(k) is None for k in (A, B, C)) and C not in r.index
    assert r.index.free_slots == 1
    r.store_failed(B, dram_ok=False)  # a fenced key's report changes nothing before the flush
    r.write_ended(B)  # (a worker reports the end of every store through a slot, failed or not)
    assert B in r.index
    r.reset_flushed()
    assert B not in r.index and A in r.index  # A's write still reads its slot
    r.write_ended(A)
    assert A not in r.index and r.index.free_slots == 3


def test_a_fenced_promotion_is_not_committed_by_its_late_completion():
    r = DramResidency(2)
    r.promotion_slot(A)
    r.reset()
    r.loads_ended([A])
    assert r.slot_of(A) is None and r.holds(A)  # neither a hit nor stored again until the flush
    r.reset_flushed()
    assert not r.holds(A)


# -- several workers (tensor parallel ranks): every rank's write end counts ------------------------
def free_slots_for(r: DramResidency, salt: bytes) -> set[int]:
    """The slots the tier would hand out now to as many new stores as it has slots (tried on a copy)."""
    probe = copy.deepcopy(r)
    return {s for i in range(r.capacity) if (s := probe.begin_store(salt + bytes([i]) * 35)) is not None}


@pytest.mark.parametrize("events", list(itertools.permutations(["done", 0, 1, 2])),
                         ids=lambda e: "-".join(map(str, e)))
def test_a_slot_is_free_only_once_the_store_completed_and_every_rank_reported_its_end(events):
    r = DramResidency(2, early_release=True, workers=3)
    slot = r.begin_store(A)
    for i, event in enumerate(events):
        assert r.index.entry(A).pins == 1 and slot not in free_slots_for(r, bytes([i]))
        if event == "done":
            r.store_completed([A])
        else:
            r.write_ended(A, event)
            r.write_ended(A, event)  # a rank's report twice counts once
    assert r.index.entry(A).pins == 0 and r.slot_of(A) == slot and not r.writes()


def test_reports_of_unknown_ranks_and_stale_reports_change_nothing():
    r = DramResidency(2, early_release=True, workers=2)
    slot, = stored(r, A)
    r.write_ended(A, 2)
    r.write_ended(A, -1)
    r.write_ended(B, 0)
    assert r.writes() == {A: frozenset()} and r.index.entry(A).pins == 1
    r.write_ended(A, 1)
    r.write_ended(A, 0)
    r.write_ended(A, 0)  # after the slot is free: stale
    assert r.index.entry(A).pins == 0 and r.slot_of(A) == slot


@pytest.mark.parametrize("events", [e for e in itertools.permutations(["failed", "done", 0, 1])
                                    if e.index("failed") < e.index("done")],  # the failing rank's job ends first
                         ids=lambda e: "-".join(map(str, e)))
def test_a_store_one_rank_could_not_stage_is_never_a_hit_and_its_slot_waits_for_every_rank(events):
    r = DramResidency(2, early_release=True, workers=2)
    slot = r.begin_store(A)
    for i, event in enumerate(events):
        assert r.slot_of(A) is None and r.holds(A) and slot not in free_slots_for(r, bytes([i]))
        if event == "failed":
            r.store_failed(A, dram_ok=False)
        elif event == "done":
            r.store_completed([A])
        else:
            r.write_ended(A, event)
    assert A not in r.index and not r.holds(A) and slot in free_slots_for(r, b"z")


def test_a_write_that_failed_on_one_rank_keeps_the_dram_hit():
    r = DramResidency(2, early_release=True, workers=2)
    slot, = stored(r, A)
    r.store_failed(A, dram_ok=True)  # rank 1's file was not written; every rank's slot holds the block
    r.write_ended(A, 1)
    r.write_ended(A, 0)
    assert r.slot_of(A) == slot and r.index.entry(A).pins == 0


def test_a_reset_with_some_ranks_still_writing_frees_the_slot_after_the_flush_and_the_last_end():
    r = DramResidency(2, early_release=True, workers=2)
    slot, = stored(r, A)
    r.pin_hit(A)  # a load in flight at the reset too
    r.write_ended(A, 0)
    r.reset()
    assert r.slot_of(A) is None and slot not in free_slots_for(r, b"x")
    r.reset_flushed()
    assert A in r.index and r.writes() == {A: frozenset({0})}  # rank 1 still writes from it
    assert slot not in free_slots_for(r, b"y")
    r.loads_ended([A])  # the pre-reset load's late completion changes nothing
    r.write_ended(A, 1)
    assert A not in r.index and slot in free_slots_for(r, b"w")


def test_store_pause_starts_once_and_ends_after_its_interval():
    pause = StorePause(10.0)
    assert not pause.active(0.0)
    assert pause.begin(5.0) is True and pause.active(14.9)
    assert pause.begin(8.0) is False  # already paused: one warning per pause, not extended
    assert not pause.active(15.0)
    extending = StorePause(10.0, extend=True)
    extending.begin(5.0)
    assert extending.begin(8.0) is False and extending.active(17.0) and not extending.active(18.0)


def test_tier_names_are_the_strings_the_gate_and_vllm_use():
    assert Tier.DRAM == "dram" and Tier.DISK == "disk"


def test_the_ledgers_and_the_store_import_neither_vllm_nor_torch():
    from pure_imports import assert_imports_neither_vllm_nor_torch
    assert_imports_neither_vllm_nor_torch("pykv.residency", "pykv.jobledger", "pykv.store", "pykv.tiers")
