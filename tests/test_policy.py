"""The reactor policy as a pure state machine: bounds, priorities, slot ownership."""

from __future__ import annotations

import pytest

from pykv.policy import Deliver, Fill, Finish, Kind, Open, ReactorPolicy, Read, Stage, Write
from pykv.staging import SlotLedger


def make(slots: int = 4, depth: int = 2, ahead: int = 3) -> ReactorPolicy:
    return ReactorPolicy(SlotLedger(slots), io_depth=depth, open_ahead=ahead)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_opens_are_bounded_by_look_ahead():
    policy = make(ahead=3)
    for i in range(10):
        policy.add(i, Kind.LOAD)
    assert [a.transfer for a in of(policy.step(), Open)] == [0, 1, 2]
    assert of(policy.step(), Open) == []


def test_reads_bounded_by_depth_and_each_read_owns_a_distinct_slot():
    policy = make(slots=8, depth=2, ahead=4)
    for i in range(4):
        policy.add(i, Kind.LOAD)
    policy.step()
    for i in range(4):
        policy.opened(i, ok=True)
    reads = of(policy.step(), Read)
    assert [r.transfer for r in reads] == [0, 1]
    assert len({r.slot for r in reads}) == 2
    assert policy.ledger.free == 6


def test_request_larger_than_pool_proceeds_slot_by_slot():
    policy = make(slots=2, depth=4, ahead=4)
    total = 9
    for i in range(total):
        policy.add(i, Kind.LOAD)
    delivered: list[int] = []
    held_max = 0
    for _ in range(100):
        actions = policy.step()
        for a in of(actions, Open):
            policy.opened(a.transfer, ok=True)
        for a in of(actions, Read):
            policy.read_done(a.transfer, ok=True)
        for a in of(actions, Deliver):
            for tid, _slot in a.blocks:
                delivered.append(tid)
                policy.consumed(tid)
        held_max = max(held_max, 2 - policy.ledger.free)
        if all(policy.stage(i) is Stage.DONE for i in range(total)):
            break
    assert sorted(delivered) == list(range(total))
    assert held_max <= 2
    assert policy.ledger.free == 2


def test_ready_loads_of_one_step_are_delivered_as_one_batch():
    policy = make(slots=4, depth=4, ahead=4)
    for i in range(3):
        policy.add(i, Kind.LOAD)
    policy.step()
    for i in range(3):
        policy.opened(i, ok=True)
    for r in of(policy.step(), Read):
        policy.read_done(r.transfer, ok=True)
    delivers = of(policy.step(), Deliver)
    assert len(delivers) == 1
    assert [tid for tid, _ in delivers[0].blocks] == [0, 1, 2]


def test_opened_demand_loads_get_slots_before_new_stores():
    policy = make(slots=1, depth=2, ahead=2)
    policy.add(0, Kind.LOAD)
    policy.step()
    policy.opened(0, ok=True)
    policy.add(1, Kind.STORE)
    actions = policy.step()
    assert of(actions, Read) and not of(actions, Fill)
    assert policy.stage(1) is Stage.QUEUED


def test_store_pipeline_fill_then_write_then_finish_releases_slot():
    policy = make(slots=2, depth=1)
    policy.add(7, Kind.STORE)
    fill = of(policy.step(), Fill)[0]
    assert policy.ledger.free == 1
    policy.filled(7, ok=True)
    write = of(policy.step(), Write)[0]
    assert write.slot == fill.slot
    policy.written(7, ok=True)
    assert of(policy.step(), Finish) == [Finish(7, True)]
    assert policy.ledger.free == 2


def test_only_a_store_still_waiting_for_a_slot_is_shed():
    policy = make(slots=1, depth=1)
    policy.add(0, Kind.STORE)
    policy.add(1, Kind.STORE)
    policy.add(2, Kind.LOAD)
    assert [a.transfer for a in of(policy.step(), Fill)] == [0]  # one slot: store 1 queues
    assert not policy.shed(0)  # being filled: its copy goes on
    assert not policy.shed(2)  # a load is never shed
    assert policy.shed(1) and not policy.shed(1)
    assert Finish(1, False) in policy.step() and policy.stage(1) is Stage.DONE
    policy.filled(0, ok=True)
    assert of(policy.step(), Write)[0].transfer == 0  # the store being filled is written as usual
    assert not policy.shed(0)
    policy.written(0, ok=True)
    assert Finish(0, True) in policy.step() and policy.ledger.free == 1


def test_a_store_that_brought_its_slot_is_filled_even_behind_one_waiting_for_a_slot():
    policy = make(slots=1, depth=1)
    policy.add(0, Kind.STORE)
    policy.add(1, Kind.STORE)  # no ledger slot left for it
    policy.add(2, Kind.STORE, slot=7)  # a DRAM-tier slot of its own
    assert [(a.transfer, a.slot) for a in of(policy.step(), Fill)] == [(0, 0), (2, 7)]
    assert policy.stage(1) is Stage.QUEUED and not policy.shed(2)
    policy.filled(2, ok=True)
    assert of(policy.step(), Write)[0].transfer == 2


def test_writes_respect_io_depth():
    policy = make(slots=4, depth=1)
    for i in range(3):
        policy.add(i, Kind.STORE)
    for a in of(policy.step(), Fill):
        policy.filled(a.transfer, ok=True)
    assert len(of(policy.step(), Write)) == 1
    assert of(policy.step(), Write) == []


@pytest.mark.parametrize("stage", ["open", "read"])
def test_failures_release_slot_and_finish_not_ok(stage):
    policy = make()
    policy.add(0, Kind.LOAD)
    policy.step()
    if stage == "open":
        policy.opened(0, ok=False)
    else:
        policy.opened(0, ok=True)
        policy.step()
        policy.read_done(0, ok=False)
    assert Finish(0, False) in policy.step()
    assert policy.ledger.free == 4
    assert policy.stage(0) is Stage.DONE


def test_only_one_speculative_preload_at_a_time():
    policy = make(slots=16, depth=2, ahead=8)
    for i in range(3):
        policy.add(i, Kind.PRELOAD)
    assert [a.transfer for a in of(policy.step(), Open)] == [0]
    assert of(policy.step(), Open) == []
    policy.opened(0, ok=False)
    assert [a.transfer for a in of(policy.step(), Open)] == [1]


def test_preloads_never_use_the_foreground_reserve():
    policy = make(slots=3, depth=2, ahead=4)  # reserve = 2 slots -> preload needs 3 free
    policy.add(0, Kind.PRELOAD)
    policy.step()
    policy.opened(0, ok=True)
    policy.add(1, Kind.STORE)
    actions = policy.step()  # the store takes a slot first; 2 left == reserve
    assert of(actions, Fill) and not of(actions, Read)
    policy.filled(1, ok=True)
    policy.step()
    policy.written(1, ok=True)
    actions = policy.step()
    assert [a.transfer for a in of(actions, Read)] == [0]


def test_demand_loads_open_before_preloads():
    policy = make(ahead=1)
    policy.add(0, Kind.PRELOAD)
    policy.add(1, Kind.LOAD)
    assert [a.transfer for a in of(policy.step(), Open)] == [1]


def test_events_in_the_wrong_stage_are_refused():
    policy = make()
    policy.add(0, Kind.LOAD)
    with pytest.raises(ValueError, match="expected stage opening"):
        policy.opened(0, ok=True)
    with pytest.raises(ValueError, match="already exists"):
        policy.add(0, Kind.LOAD)


def test_a_transfer_with_its_own_slot_takes_none_from_the_ledger():
    policy = ReactorPolicy(SlotLedger(4, reserved=2), io_depth=2, open_ahead=2)
    policy.add(0, Kind.STORE, slot=3)
    fill = of(policy.step(), Fill)[0]
    assert fill.slot == 3 and policy.ledger.free == 2
    policy.filled(0, ok=True)
    policy.step()
    policy.written(0, ok=True)
    policy.step()
    assert policy.ledger.free == 2  # nothing went back to the ledger either


def _index_matches_a_scan(policy: ReactorPolicy) -> None:
    """Every live transfer sits in exactly its (stage, category, lane) bucket, in FIFO order."""
    scanned: dict = {}
    for t in policy._transfers.values():
        scanned.setdefault((t.stage, t.category, t.lane), []).append(t.order)
    indexed = {(stage, category, lane): orders for (stage, category), lanes in policy._index._buckets.items()
               for lane, (orders, members) in lanes.items() if orders}
    assert indexed == {key: sorted(orders) for key, orders in scanned.items()}


@pytest.mark.parametrize("seed", range(5))
def test_stage_index_stays_exact_under_random_events(seed):
    """Loads, stores, preloads, claims, releases and failures in random order."""
    import random
    rng = random.Random(seed)
    policy = ReactorPolicy(SlotLedger(6), io_depth=2, open_ahead=3, max_speculative=2)
    ids, in_flight, preloads = iter(range(10 ** 6)), [], []
    for _ in range(3000):
        r = rng.random()
        if r < 0.15:
            tid = next(ids)
            kind = rng.choice([Kind.LOAD, Kind.STORE, Kind.PRELOAD])
            policy.add(tid, kind)
            if kind is Kind.PRELOAD:
                preloads.append(tid)
        elif r < 0.2 and preloads:
            policy.claim(rng.choice(preloads), next(ids))
        elif r < 0.25 and preloads:
            policy.release(rng.choice(preloads))
        for action in policy.step():
            if isinstance(action, (Open, Read, Fill, Write)):
                in_flight.append(action)
            elif isinstance(action, Deliver):
                in_flight.extend(action.blocks)
        if in_flight and rng.random() < 0.7:
            action = in_flight.pop(rng.randrange(len(in_flight)))
            ok = rng.random() < 0.9
            if isinstance(action, Open):
                policy.opened(action.transfer, ok)
            elif isinstance(action, Read):
                policy.read_done(action.transfer, ok)
            elif isinstance(action, Fill):
                policy.filled(action.transfer, ok)
            elif isinstance(action, Write):
                policy.written(action.transfer, ok)
            else:
                policy.consumed(action[0])
        _index_matches_a_scan(policy)
