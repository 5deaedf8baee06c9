"""Per-device (lane) bounds and the VERIFYING stage of the pure reactor policy."""

from __future__ import annotations

import random

import pytest

from pykv.policy import Deliver, Fill, Finish, Kind, Open, ReactorPolicy, Read, Stage, Write
from pykv.policy_index import StageIndex
from pykv.staging import SlotLedger


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def make(slots: int = 16, depth: int = 2, ahead: int = 3, lanes: int = 2, **kwargs) -> ReactorPolicy:
    return ReactorPolicy(SlotLedger(slots), io_depth=depth, open_ahead=ahead, lanes=lanes, **kwargs)


# -- a stalled lane does not starve the others -----------------------------------------------------
def test_a_lane_whose_reads_never_complete_does_not_stop_the_other_lane():
    policy = make(slots=8, depth=2, ahead=3)
    lane_of = {i: i % 2 for i in range(40)}  # even ids on lane 0, odd ids on a stalled lane 1
    for tid, lane in lane_of.items():
        policy.add(tid, Kind.LOAD, lane=lane)
    delivered: list[int] = []
    stalled_reads: set[int] = set()
    for _ in range(200):
        actions = policy.step()
        for a in of(actions, Open):
            policy.opened(a.transfer, ok=True)
        for a in of(actions, Read):
            if lane_of[a.transfer]:
                stalled_reads.add(a.transfer)  # never completes
            else:
                policy.read_done(a.transfer, ok=True)
        for a in of(actions, Deliver):
            for tid, _slot in a.blocks:
                delivered.append(tid)
                policy.consumed(tid)
    assert sorted(delivered) == [tid for tid, lane in lane_of.items() if lane == 0]
    assert len(stalled_reads) == 2  # lane 1 keeps its own depth, no more
    assert policy.ledger.free == 8 - 2
    waiting_opened = [tid for tid, lane in lane_of.items() if lane and policy.stage(tid) is Stage.OPENED]
    assert len(waiting_opened) == 3  # lane 1's window is full of its own opened blocks, nobody else's


def test_stores_of_a_stalled_lane_do_not_hold_the_other_lanes_writes():
    policy = make(slots=8, depth=1, ahead=2)
    for tid in range(6):
        policy.add(tid, Kind.STORE, lane=tid % 2)
    written: list[int] = []
    for _ in range(50):
        actions = policy.step()
        for a in of(actions, Fill):
            policy.filled(a.transfer, ok=True)
        for a in of(actions, Write):
            if a.transfer % 2 == 0:
                policy.written(a.transfer, ok=True)
            written.append(a.transfer)
    assert sorted(written) == [0, 1, 2, 4]  # lane 1 wrote one (its depth) and waits; lane 0 finished


# -- the caps hold per lane ------------------------------------------------------------------------
def _check_caps(policy: ReactorPolicy, lane_of: dict[int, int], depth: int, ahead: int) -> tuple[list, list]:
    io = [0] * policy.lanes
    window = [0] * policy.lanes
    for tid, lane in list(lane_of.items()):
        stage = policy.stage(tid)
        if stage is Stage.DONE:
            del lane_of[tid]
        io[lane] += stage in (Stage.READING, Stage.WRITING)
        window[lane] += stage in (Stage.OPENING, Stage.OPENED)
    assert max(io) <= depth and max(window) <= ahead, (io, window)
    return io, window


@pytest.mark.parametrize("seed", range(4))
def test_per_lane_caps_hold_under_random_events(seed):
    rng = random.Random(seed)
    depth, ahead, lanes = 2, 3, 3
    policy = make(slots=12, depth=depth, ahead=ahead, lanes=lanes, max_speculative=4)
    lane_of: dict[int, int] = {}
    ids = iter(range(10 ** 6))
    pending: list = []
    saturated_io, saturated_window = set(), set()
    preloads: list[int] = []
    for _ in range(2000):
        for _ in range(rng.randrange(3)):
            tid, lane = next(ids), rng.randrange(lanes)
            lane_of[tid] = lane
            kind = rng.choice([Kind.LOAD, Kind.LOAD, Kind.STORE, Kind.PRELOAD])
            policy.add(tid, kind, lane=lane, urgent=kind is Kind.LOAD and rng.random() < 0.1)
            preloads += [tid] * (kind is Kind.PRELOAD)
        if preloads and rng.random() < 0.3:
            policy.release(preloads.pop(rng.randrange(len(preloads))))
        for action in policy.step():
            if isinstance(action, Deliver):
                pending.extend(("consume", tid) for tid, _ in action.blocks)
            elif not isinstance(action, Finish):
                pending.append(action)
        io, window = _check_caps(policy, lane_of, depth, ahead)
        saturated_io |= {lane for lane in range(lanes) if io[lane] == depth}
        saturated_window |= {lane for lane in range(lanes) if window[lane] == ahead}
        for _ in range(rng.randrange(4)):
            if not pending:
                break
            action = pending.pop(rng.randrange(len(pending)))
            ok = rng.random() < 0.95
            if isinstance(action, Open):
                policy.opened(action.transfer, ok)
            elif isinstance(action, Read):
                if rng.random() < 0.5:
                    policy.read_done(action.transfer, ok)
                else:
                    policy.io_done(action.transfer)
                    pending.append(("verified", action.transfer))
            elif isinstance(action, Fill):
                policy.filled(action.transfer, ok)
            elif isinstance(action, Write):
                policy.written(action.transfer, ok)
            elif action[0] == "verified":
                policy.verified(action[1], ok)
            else:
                policy.consumed(action[1])
        _check_caps(policy, lane_of, depth, ahead)
    assert saturated_io == saturated_window == set(range(lanes))  # the caps were reached, not merely respected


def test_each_lane_opens_up_to_its_own_window_in_fifo_order_and_urgent_loads_go_first():
    policy = make(depth=2, ahead=2, lanes=2)
    for tid in range(6):
        policy.add(tid, Kind.LOAD, lane=0)
    policy.add(6, Kind.LOAD, lane=1)
    policy.add(7, Kind.LOAD, lane=1, urgent=True)
    assert [a.transfer for a in of(policy.step(), Open)] == [7, 0, 1, 6]


def test_a_lane_outside_the_medium_is_refused():
    with pytest.raises(ValueError, match="lane 2 is outside 0..1"):
        make(lanes=2).add(0, Kind.LOAD, lane=2)


# -- a step passes over a saturated lane's queue without visiting it --------------------------------
class CountingIndex(StageIndex):
    """Counts the transfers the policy is handed while it walks buckets."""

    visited = 0

    def oldest_first(self, stage, category, lane):
        for t in super().oldest_first(stage, category, lane):
            self.visited += 1
            yield t


def test_a_step_does_not_walk_the_queue_of_a_saturated_lane():
    index = CountingIndex()
    policy = ReactorPolicy(SlotLedger(8), io_depth=2, open_ahead=2, lanes=2, _index=index)
    for tid in range(5000):
        policy.add(tid, Kind.LOAD, lane=1)  # lane 1: thousands queued behind a stalled device
    policy.add(5000, Kind.LOAD, lane=0)
    policy.add(5001, Kind.LOAD, lane=0)
    opens = [a.transfer for a in of(policy.step(), Open)]
    assert opens == [0, 1, 5000, 5001]
    for tid in range(5002, 5010):
        policy.add(tid, Kind.LOAD, lane=0)
    policy.opened(5000, ok=True)
    index.visited = 0
    assert [a.transfer for a in of(policy.step(), Read)] == [5000]
    assert [a.transfer for a in of(policy.step(), Open)] == [5002]  # 5000 left the window: one more opens
    assert index.visited <= 12  # a few bucket heads per step, not the 4,998 waiting on lane 1


# -- VERIFYING: the payload check holds the slot, not the I/O depth ------------------------------------
def _open_all(policy: ReactorPolicy) -> list[Read]:
    reads = []
    for _ in range(5):
        actions = policy.step()
        for a in of(actions, Open):
            policy.opened(a.transfer, ok=True)
        reads += of(actions, Read)
    return reads


def test_blocks_being_verified_free_the_io_depth_for_the_next_reads():
    policy = make(slots=4, depth=1, ahead=4, lanes=1)
    for tid in range(3):
        policy.add(tid, Kind.LOAD)
    assert [r.transfer for r in _open_all(policy)] == [0]
    policy.io_done(0)
    assert policy.stage(0) is Stage.VERIFYING
    assert [r.transfer for r in of(policy.step(), Read)] == [1]  # depth free while 0 is hashed
    policy.io_done(1)
    assert [r.transfer for r in of(policy.step(), Read)] == [2]
    assert policy.ledger.free == 1  # every verifying block keeps its slot
    policy.verified(1, ok=True)
    assert of(policy.step(), Deliver) == [Deliver(((1, 1),))]
    policy.verified(0, ok=False)
    assert Finish(0, False) in policy.step()
    assert policy.stage(0) is Stage.DONE and policy.ledger.free == 2  # 0's slot back; 1 is delivered


def test_a_preload_being_verified_is_joined_and_released_like_one_reading():
    policy = make(slots=8, depth=1, ahead=2, lanes=1)
    policy.add(0, Kind.PRELOAD)
    policy.add(1, Kind.PRELOAD)
    reads = _open_all(policy)
    assert [r.transfer for r in reads] == [0]
    policy.io_done(0)
    assert policy.claim(0, 10)  # a demand load joins the verifying preload
    assert policy.stage(10) is Stage.JOINED
    policy.verified(0, ok=True)
    actions = policy.step()
    assert of(actions, Deliver) == [Deliver(((10, reads[0].slot),))]
    assert of(actions, Open) == [Open(1)]  # 0 no longer reads: the next speculative one opens
    policy.consumed(10)
    policy.release(0)
    policy.opened(1, ok=True)
    read = [r for r in _open_all(policy) if r.transfer == 1][0]
    policy.io_done(1)
    policy.release(1)  # nobody wants it: it ends once verified, and frees its slot
    assert policy.stage(1) is Stage.VERIFYING
    policy.verified(1, ok=True)
    assert policy.stage(1) is Stage.DONE and policy.ledger.refs(read.slot) == 0


def test_verification_events_in_the_wrong_stage_are_refused():
    policy = make(lanes=1)
    policy.add(0, Kind.LOAD)
    with pytest.raises(ValueError, match="expected stage reading"):
        policy.io_done(0)
    with pytest.raises(ValueError, match="expected stage verifying"):
        policy.verified(0, ok=True)


# -- preloads with lanes ---------------------------------------------------------------------------
def test_one_speculative_preload_per_lane_and_the_reserve_scales_with_lanes():
    depth, lanes = 2, 2
    policy = make(slots=depth * lanes + 1, depth=depth, ahead=4, lanes=lanes)
    for tid in range(4):
        policy.add(tid, Kind.PRELOAD, lane=tid % 2)
    assert sorted(a.transfer for a in of(policy.step(), Open)) == [0, 1]  # one per lane
    policy.opened(0, ok=True)
    policy.opened(1, ok=True)
    reads = of(policy.step(), Read)
    assert len(reads) == 1  # the second would leave only io_depth * lanes slots free
    policy.add(9, Kind.LOAD, lane=1)
    assert [a.transfer for a in of(policy.step(), Open)] == [9]  # demand still opens
