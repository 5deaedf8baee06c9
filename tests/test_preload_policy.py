"""Preloading rules of the pure reactor policy (paper section 6.5), one test per rule."""

from __future__ import annotations

import pytest

from pykv.policy import Deliver, Fill, Finish, Kind, Open, ReactorPolicy, Read, Stage
from pykv.staging import SlotLedger


def make(slots: int = 8, depth: int = 2, ahead: int = 4, max_speculative: int | None = None,
         reserved: int = 0) -> ReactorPolicy:
    return ReactorPolicy(SlotLedger(slots, reserved), io_depth=depth, open_ahead=ahead,
                         max_speculative=max_speculative)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def read_preload(policy: ReactorPolicy, tid: int) -> int:
    """Drive preload ``tid`` (already added) to READY; return its slot."""
    slot = None
    for _ in range(10):
        actions = policy.step()
        for a in of(actions, Open):
            if a.transfer == tid:
                policy.opened(tid, ok=True)
        for a in of(actions, Read):
            if a.transfer == tid:
                slot = a.slot
                policy.read_done(tid, ok=True)
        if policy.stage(tid) is Stage.READY:
            return slot
    raise AssertionError(f"preload {tid} did not become ready: {policy.stage(tid)}")


# -- rule: at most one speculative preload at a time --------------------------------------------
def test_one_speculative_preload_in_io_at_a_time_ready_ones_do_not_block_the_next():
    policy = make(slots=16, depth=2, ahead=8)
    for i in range(3):
        policy.add(i, Kind.PRELOAD)
    assert [a.transfer for a in of(policy.step(), Open)] == [0]
    policy.opened(0, ok=True)
    actions = policy.step()
    assert [a.transfer for a in of(actions, Read)] == [0] and not of(actions, Open)  # 0 still reading
    policy.read_done(0, ok=True)
    assert policy.stage(0) is Stage.READY
    assert [a.transfer for a in of(policy.step(), Open)] == [1]  # READY holds a slot, not the turn


def test_a_claimed_preload_is_demand_work_and_frees_the_speculative_turn():
    policy = make(slots=16, depth=2, ahead=8)
    policy.add(0, Kind.PRELOAD)
    policy.add(1, Kind.PRELOAD)
    policy.step()  # 0 opens
    assert policy.claim(0, 10)
    assert [a.transfer for a in of(policy.step(), Open)] == [1]


# -- rule: demand reads first, then new demand loads and stores, then preloads ------------------
def test_priorities_demand_reads_then_new_demand_work_then_preloads():
    policy = make(slots=4, depth=1, ahead=4)
    policy.add(0, Kind.LOAD)
    policy.step()
    policy.opened(0, ok=True)  # an opened demand load wants a read
    policy.add(1, Kind.PRELOAD)
    policy.add(2, Kind.LOAD)
    policy.add(3, Kind.STORE)
    actions = policy.step()
    assert [a.transfer for a in of(actions, Read)] == [0]  # the one I/O slot goes to the demand read
    assert [a.transfer for a in of(actions, Open)] == [2, 1]  # demand opens before the preload's
    assert [a.transfer for a in of(actions, Fill)] == [3]
    policy.opened(1, ok=True)
    policy.opened(2, ok=True)
    policy.read_done(0, ok=True)
    actions = policy.step()
    assert [a.transfer for a in of(actions, Read)] == [2]  # opened demand load beats the opened preload


# -- rule: foreground work keeps as many slots as the I/O depth (test_policy.py:
#    test_preloads_never_use_the_foreground_reserve); speculative bytes bounded ---------------
def test_max_speculative_bounds_the_slots_preloads_hold():
    policy = make(slots=16, depth=1, ahead=8, max_speculative=2)
    for i in range(4):
        policy.add(i, Kind.PRELOAD)
    read_preload(policy, 0)
    read_preload(policy, 1)
    assert policy.speculative_slots == 2
    for _ in range(5):
        for a in of(policy.step(), Open):
            policy.opened(a.transfer, ok=True)
    assert policy.stage(2) is Stage.OPENED  # opened, but no slot for a third
    assert policy.speculative_slots == 2
    policy.release(0)
    assert [a.transfer for a in of(policy.step(), Read)] == [2]


# -- rule: demand may reclaim slots of unclaimed preloads ---------------------------------------
def test_demand_reclaims_the_youngest_idle_ready_preload():
    policy = make(slots=4, depth=1, ahead=4)
    for i in range(3):
        policy.add(i, Kind.PRELOAD)
        read_preload(policy, i)
    assert policy.ledger.free == 1
    policy.add(10, Kind.LOAD)
    policy.add(11, Kind.LOAD)
    policy.step()
    policy.opened(10, ok=True)
    assert of(policy.step(), Read)[0].transfer == 10  # the free slot
    policy.opened(11, ok=True)
    policy.read_done(10, ok=True)
    actions = policy.step()
    assert [a.transfer for a in of(actions, Read)] == [11]
    assert Finish(2, False) in actions or Finish(2, False) in policy.step()  # youngest preload gave way
    assert policy.stage(0) is Stage.READY and policy.stage(1) is Stage.READY


def test_stores_reclaim_too_but_never_a_preload_slot_in_use():
    policy = make(slots=2, depth=1, ahead=2)
    policy.add(0, Kind.PRELOAD)
    slot = read_preload(policy, 0)
    policy.add(1, Kind.LOAD)
    assert policy.claim(0, 2)  # a load shares the preload's slot (refs 2)
    policy.add(3, Kind.STORE)  # takes the one free slot
    policy.add(4, Kind.STORE)  # no slot and nothing idle to reclaim
    actions = policy.step()
    assert [a.transfer for a in of(actions, Fill)] == [3]
    assert policy.stage(4) is Stage.QUEUED and policy.stage(0) is Stage.READY
    assert (2, slot) in of(actions, Deliver)[0].blocks


def test_preloads_never_reclaim():
    policy = make(slots=3, depth=1, ahead=4)
    for i in range(3):
        policy.add(i, Kind.PRELOAD)
    for _ in range(10):
        actions = policy.step()
        for a in of(actions, Open):
            policy.opened(a.transfer, ok=True)
        for a in of(actions, Read):
            policy.read_done(a.transfer, ok=True)
    assert [policy.stage(i) for i in range(3)] == [Stage.READY, Stage.READY, Stage.OPENED]
    assert policy.ledger.free == 1  # the foreground's reserve; preload 2 waits, 0 and 1 stay


# -- rule: a demand load that hits a block being preloaded: no double read ----------------------
def test_demand_load_of_a_queued_preload_promotes_it_to_demand_and_reads_once():
    policy = make(slots=8, depth=2, ahead=4)
    policy.add(1, Kind.PRELOAD)
    policy.add(2, Kind.PRELOAD)
    policy.step()  # preload 1 opens (the speculative turn); 2 waits
    assert policy.stage(2) is Stage.QUEUED
    assert policy.claim(2, 20)  # 2's speculative wait is cancelled: re-queued as demand work
    opens, reads, delivered = [], [], []
    for _ in range(6):
        actions = policy.step()
        opens += [a.transfer for a in of(actions, Open)]
        reads += [a.transfer for a in of(actions, Read)]
        for a in of(actions, Deliver):
            delivered += [tid for tid, _ in a.blocks]
        if 2 in opens and policy.stage(2) is Stage.OPENING:
            policy.opened(2, ok=True)
        if 2 in reads and policy.stage(2) is Stage.READING:
            policy.read_done(2, ok=True)
    assert opens == [2] and reads == [2]  # opened although preload 1 holds the speculative turn
    assert delivered == [20]


def test_demand_load_joins_an_in_flight_preload_read():
    policy = make()
    policy.add(0, Kind.PRELOAD)
    policy.step()
    policy.opened(0, ok=True)
    read = of(policy.step(), Read)[0]
    assert policy.claim(0, 10)
    assert policy.stage(10) is Stage.JOINED
    assert not of(policy.step(), Deliver)
    policy.read_done(0, ok=True)
    actions = policy.step()
    assert of(actions, Deliver)[0].blocks == ((10, read.slot),)
    assert not of(actions, Open) and not of(actions, Read)


def test_demand_load_of_a_ready_preload_is_delivered_in_the_next_batch_without_io():
    policy = make()
    policy.add(0, Kind.PRELOAD)
    slot = read_preload(policy, 0)
    assert policy.claim(0, 10)
    actions = policy.step()
    assert of(actions, Deliver)[0].blocks == ((10, slot),)
    assert not of(actions, Open) and not of(actions, Read)
    policy.consumed(10)
    assert policy.ledger.refs(slot) == 1  # the preload still holds it


def test_a_failed_preload_re_queues_its_joined_loads():
    policy = make()
    policy.add(0, Kind.PRELOAD)
    policy.step()
    policy.opened(0, ok=True)
    policy.step()
    policy.claim(0, 10)
    policy.read_done(0, ok=False)
    actions = policy.step()
    assert Finish(0, False) in actions and [a.transfer for a in of(actions, Open)] == [10]


def test_claim_of_a_gone_preload_is_refused():
    policy = make()
    policy.add(0, Kind.PRELOAD)
    policy.release(0)
    assert policy.claim(0, 10) is False
    assert policy.claim(99, 11) is False
    with pytest.raises(ValueError, match="already exists"):
        policy.add(1, Kind.PRELOAD)
        read_preload(policy, 1)
        policy.claim(1, 1)


# -- rule: several waiting requests sharing a prefix share one read and one ref-counted slot ----
def test_shared_prefix_one_read_one_ref_counted_slot():
    policy = make()
    policy.add(0, Kind.PRELOAD)
    reads = opens = 0
    slot = None
    for _ in range(6):
        actions = policy.step()
        opens += len(of(actions, Open))
        reads += len(of(actions, Read))
        for a in of(actions, Open):
            policy.opened(a.transfer, ok=True)
        for a in of(actions, Read):
            slot = a.slot if a.transfer == 0 else slot
            policy.read_done(a.transfer, ok=True)
    assert policy.claim(0, 10) and policy.claim(0, 11) and policy.claim(0, 12)
    assert policy.ledger.refs(slot) == 4
    delivered = of(policy.step(), Deliver)[0].blocks
    assert delivered == ((10, slot), (11, slot), (12, slot))
    for tid in (10, 11, 12):
        policy.consumed(tid)
    policy.release(0)
    policy.step()
    assert (opens, reads) == (1, 1)
    assert policy.ledger.refs(slot) == 0 and policy.ledger.free == 8


def test_a_released_preload_keeps_the_slot_for_loads_still_using_it():
    policy = make()
    policy.add(0, Kind.PRELOAD)
    slot = read_preload(policy, 0)
    policy.claim(0, 10)
    policy.release(0)
    assert Finish(0, True) in policy.step()  # the Deliver of 10 goes out in the same step
    assert policy.ledger.refs(slot) == 1
    policy.consumed(10)
    assert policy.ledger.refs(slot) == 0


# -- rule: a preloaded block whose request finishes or is aborted is released -------------------
@pytest.mark.parametrize("stage", ["queued", "opening", "opened", "reading", "ready"])
def test_release_frees_the_preload_at_every_stage(stage):
    policy = make(slots=4, depth=1)
    policy.add(0, Kind.PRELOAD)
    if stage != "queued":
        policy.step()
    if stage in ("opened", "reading", "ready"):
        policy.opened(0, ok=True)
    if stage in ("reading", "ready"):
        policy.step()
    if stage == "ready":
        policy.read_done(0, ok=True)
    policy.release(0)
    if stage == "opening":
        assert policy.stage(0) is Stage.OPENING  # the open completes first
        policy.opened(0, ok=True)
    elif stage == "reading":
        policy.read_done(0, ok=True)
    actions = policy.step()
    assert [f.transfer for f in of(actions, Finish)] == [0]
    assert not of(actions, Read) and policy.stage(0) is Stage.DONE and policy.ledger.free == 4


# -- rule: preloading never evicts DRAM-tier blocks a running request needs ----------------------
def test_preloads_use_ledger_slots_only_never_dram_tier_slots():
    policy = make(slots=6, depth=1, reserved=2)  # slots 4 and 5: the DRAM tier's
    with pytest.raises(ValueError, match="staging slot"):
        policy.add(0, Kind.PRELOAD, slot=4)
    policy.add(1, Kind.LOAD, slot=5)  # a running request's load into its DRAM slot
    for i in range(2, 6):
        policy.add(i, Kind.PRELOAD)
    held, delivered = set(), []
    for _ in range(20):
        actions = policy.step()
        for a in of(actions, Open):
            policy.opened(a.transfer, ok=True)
        for a in of(actions, Read):
            if a.transfer != 1:
                held.add(a.slot)
            policy.read_done(a.transfer, ok=True)
        for a in of(actions, Deliver):
            delivered += a.blocks
    assert held and held <= {0, 1, 2, 3}
    assert policy.stage(1) is Stage.DELIVERED and delivered == [(1, 5)]
