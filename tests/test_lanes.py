"""``LaneCalls`` and ``DiskPresence``: blocking calls per device, answered within a deadline.

A stalled device (a call that does not return) costs a batch at most the deadline once, then
its calls answer ``None`` at once without queueing, and it never delays another device.
"""

from __future__ import annotations

import threading
import time

import pytest

from pykv.deviceset import DeviceSet
from pykv.lanes import MAX_PENDING, LaneCalls
from pykv.presence import DiskPresence
from pykv.tree import KVTree

DEADLINE = 0.3


@pytest.fixture
def stall():
    """An event the stalled calls wait on; set at teardown so no thread stays blocked."""
    gate = threading.Event()
    yield gate
    gate.set()


def test_answers_come_back_in_order_from_each_lane_and_a_failing_call_is_none():
    calls = LaneCalls(3, DEADLINE)
    try:
        def square(i: int) -> int:
            if i == 7:
                raise OSError("boom")
            time.sleep(0.001 * (i % 3))
            return i * i
        items = [(i % 3, i) for i in range(30)]
        assert calls.run(square, items) == [None if i == 7 else i * i for i in range(30)]
        assert calls.run(square, []) == []
    finally:
        assert calls.close()


def test_a_stalled_lane_costs_the_deadline_once_then_answers_at_once_and_never_delays_the_others(stall):
    calls = LaneCalls(2, DEADLINE)

    def check(item: tuple[int, int]) -> bool:
        lane, _ = item
        if lane == 1:
            stall.wait(30)
        return True
    items = [(i % 2, (i % 2, i)) for i in range(10)]
    began = time.monotonic()
    first = calls.run(check, items)
    took = time.monotonic() - began
    assert DEADLINE * 0.9 <= took < DEADLINE + 0.5
    assert first == [True if i % 2 == 0 else None for i in range(10)]
    assert calls.unanswered == 5
    time.sleep(0.05)
    assert calls.stalled() == [1]
    began = time.monotonic()
    assert calls.run(check, items) == first  # lane 1 is stalled: answered None without waiting
    assert time.monotonic() - began < DEADLINE / 2
    assert calls.unanswered == 10  # refused at once counts too
    assert calls.start(check, items) == 5  # stamps for the stalled lane are not even queued
    stall.set()  # the mount wakes: the lane answers again
    deadline = time.monotonic() + 5
    while calls.stalled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.run(check, items) == [True] * 10
    assert calls.close()


def test_close_gives_up_on_a_stalled_call_within_its_timeout_and_the_thread_is_a_daemon(stall):
    calls = LaneCalls(1, DEADLINE)
    assert calls.run(lambda _: stall.wait(30), [(0, None)]) == [None]
    began = time.monotonic()
    assert calls.close(timeout=0.2) is False
    assert time.monotonic() - began < 1.0
    assert calls.threads_alive() >= 1
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("pykv-lookup"))
    assert calls.run(lambda _: True, [(0, None)]) == [None]  # closed: nothing more is queued


def test_a_lane_queues_at_most_max_pending_calls(stall):
    calls = LaneCalls(1, 60.0, threads_per_lane=1)
    queued = calls.start(lambda _: stall.wait(30), [(0, None)] * (MAX_PENDING + 50))
    assert queued in (MAX_PENDING, MAX_PENDING + 1)  # (+1: the one its thread took off the queue at once)
    stall.set()
    calls.close(timeout=5)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        LaneCalls(0, 1.0)
    with pytest.raises(ValueError):
        LaneCalls(1, 0.0)


# -- DiskPresence over a set of devices -------------------------------------------------------
NS, NS1 = "0a" * 8, "0b" * 8


def devices(tmp_path, count: int) -> DeviceSet:
    roots = [tmp_path / f"dev{i}" for i in range(count)]
    for root in roots:
        root.mkdir()
    return DeviceSet.create(roots)


def publish(tree: KVTree, key: bytes) -> None:
    path = tree.block_path(NS, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


def test_presence_finds_blocks_on_any_candidate_and_a_stalled_device_makes_them_unknown(tmp_path, stall,
                                                                                        monkeypatch):
    set_ = devices(tmp_path, 4)
    keys = [bytes([i, 1]) * 8 for i in range(40)]
    placed = {}
    for i, key in enumerate(keys[:30]):  # each on its second candidate (a sequential search's second stat)
        placed[key] = set_.candidates(key)[1]
        publish(set_[placed[key]], key)
    presence = DiskPresence(set_, [NS], DEADLINE)
    assert presence.find(keys) == [True] * 30 + [False] * 10
    stalled = 2
    contains = KVTree.contains

    def hanging(tree, ns, key):
        if tree is set_[stalled]:
            stall.wait(30)
        return contains(tree, ns, key)
    monkeypatch.setattr(KVTree, "contains", hanging)
    began = time.monotonic()
    answers = presence.find(keys)
    assert time.monotonic() - began < 2 * DEADLINE + 0.5
    for key, answer in zip(keys, answers):
        candidates = set_.candidates(key)
        if key in placed and (stalled not in candidates or candidates.index(stalled) > 1):
            assert answer is True, key  # found before (or without) asking the stalled device
        elif key in placed and candidates[0] == stalled:
            assert answer is True  # the first candidate did not answer; the second holds it
        elif stalled in candidates:
            assert answer is None  # not found elsewhere, and the stalled device might hold it
        else:
            assert answer is False
    assert presence.unanswered > 0
    presence.close(timeout=0.1)


def test_a_key_is_on_disk_only_when_every_rank_file_is_and_stamps_touch_the_holder(tmp_path):
    set_ = devices(tmp_path, 3)
    key = b"k" * 16
    publish(set_[set_.candidates(key)[2]], key)
    presence = DiskPresence(set_, [NS, NS1], DEADLINE)
    assert presence.find([key]) == [False]  # rank 1's file is missing
    holder = set_.candidates(key)[0]
    path = set_[holder].block_path(NS1, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"y")
    assert presence.find([key]) == [True]
    old = time.time() - 3600
    import os
    for ns, device in ((NS, set_.candidates(key)[2]), (NS1, holder)):
        os.utime(set_[device].block_path(ns, key), (old, old))
    assert presence.stamp([key]) == 2
    assert presence.close(timeout=5)
    for ns, device in ((NS, set_.candidates(key)[2]), (NS1, holder)):
        assert os.stat(set_[device].block_path(ns, key)).st_atime > old + 1000


def test_stamps_go_in_short_batches_per_device_and_a_failing_or_missing_file_skips_only_itself(tmp_path,
                                                                                              monkeypatch):
    import os
    from pykv import presence as presence_module
    set_ = devices(tmp_path, 2)
    keys = [bytes([i, 2]) * 8 for i in range(100)]
    for key in keys[:90]:  # the last ten are gone (a racing gc): their stamps find nothing
        publish(set_[set_.candidates(key)[0]], key)
    old = time.time() - 3600
    for key in keys[:90]:
        os.utime(set_[set_.candidates(key)[0]].block_path(NS, key), (old, old))
    refused = keys[5]
    calls, stamp = [], KVTree.stamp

    def stamp_or_refuse(tree, ns, key):
        if key == refused:
            raise PermissionError(13, "not the owner")
        return stamp(tree, ns, key)
    monkeypatch.setattr(KVTree, "stamp", stamp_or_refuse)
    presence = DiskPresence(set_, [NS], DEADLINE)
    batch_of = presence._stamp_batch
    monkeypatch.setattr(presence, "_stamp_batch", lambda batch: (calls.append(batch), batch_of(batch)))
    assert presence.stamp(keys) == 100
    assert presence.close(timeout=5)
    assert sum(len(files) for _, files in calls) == 100
    assert all(len(files) <= presence_module.STAMP_BATCH for _, files in calls)
    assert len(calls) <= 2 + 100 // presence_module.STAMP_BATCH  # batched, not one call per file
    for device, files in calls:  # each batch went to its files' device
        assert all(set_.candidates(key)[0] == device for _, key in files)
    for key in keys[:90]:
        atime = os.stat(set_[set_.candidates(key)[0]].block_path(NS, key)).st_atime
        assert (atime < old + 1) if key == refused else (atime > old + 1000), key
