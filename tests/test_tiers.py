"""DramIndex: slot assignment, pending/valid, pins, LRU and ARC replacement."""

from __future__ import annotations

import pytest

from pykv.tiers import DramIndex


def fill(index: DramIndex, *keys: str) -> None:
    for key in keys:
        assert index.allocate(key) is not None
        index.commit(key)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_slots_are_distinct_and_reused_after_drop(policy):
    index = DramIndex(3, policy)
    slots = {index.allocate(k) for k in "abc"}
    assert slots == {0, 1, 2}
    assert index.drop("b")
    assert index.allocate("d") in slots
    with pytest.raises(ValueError):
        index.allocate("a")


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_pending_entries_do_not_answer_lookups_and_are_never_evicted(policy):
    index = DramIndex(2, policy)
    slot = index.allocate("a")
    assert index.lookup("a") is None and "a" in index
    index.allocate("b")
    assert index.allocate("c") is None  # both pending: nothing to evict
    assert index.commit("a") and index.lookup("a") == slot
    assert index.allocate("c") == slot and index.take_evicted() == ["a"]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_pinned_entries_survive_eviction(policy):
    index = DramIndex(2, policy)
    fill(index, "a", "b")
    index.pin("a")
    index.allocate("c")
    assert index.take_evicted() == ["b"]
    index.commit("c")
    index.pin("c")
    assert index.allocate("d") is None  # a and c pinned
    index.unpin("a")
    assert index.allocate("d") is not None and index.take_evicted() == ["a"]


def test_lru_evicts_least_recently_used():
    index = DramIndex(3, "lru")
    fill(index, "a", "b", "c")
    index.touch(["a"])
    index.allocate("d")
    assert index.take_evicted() == ["b"]


def test_arc_keeps_frequently_used_keys_through_a_scan():
    index = DramIndex(4, "arc")
    fill(index, "hot1", "hot2")
    index.touch(["hot1", "hot2"])  # seen twice: T2
    for i in range(10):  # a one-pass scan
        fill(index, f"scan{i}")
    assert index.lookup("hot1") is not None and index.lookup("hot2") is not None
    lru = DramIndex(4, "lru")
    fill(lru, "hot1", "hot2")
    lru.touch(["hot1", "hot2"])
    for i in range(10):
        fill(lru, f"scan{i}")
    assert lru.lookup("hot1") is None  # what ARC avoids


def test_arc_ghost_hit_adapts_target():
    index = DramIndex(2, "arc")
    fill(index, "a", "b", "c")  # evicts a into B1
    assert index.lookup("a") is None
    target = index._policy.p
    fill(index, "a")  # a B1 ghost hit grows T1's target and lands in T2
    assert index._policy.p > target and "a" in index._policy.t2


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_clear_frees_every_slot(policy):
    index = DramIndex(2, policy)
    fill(index, "a", "b")
    index.pin("a")
    index.clear()
    assert len(index) == 0 and index.free_slots == 2


def test_zero_capacity_never_allocates():
    assert DramIndex(0).allocate("a") is None


def test_bad_arguments():
    with pytest.raises(ValueError):
        DramIndex(1, "mru")
    with pytest.raises(ValueError):
        DramIndex(-1)


def test_invalidate_makes_an_entry_miss_and_keeps_its_slot_until_dropped():
    index = DramIndex(2)
    slot = index.allocate("a")
    index.commit("a")
    index.invalidate("a")
    assert index.lookup("a") is None and "a" in index
    assert index.allocate("b") is not None and index.allocate("c") is None  # "a" is not evicted
    index.drop("a")
    assert index.allocate("c") == slot


def test_clear_keeps_the_slots_it_is_told_to_keep_invalidated():
    index = DramIndex(3)
    for key in "abc":
        index.allocate(key)
        index.commit(key)
    kept = index.entry("b").slot
    index.clear(keep=["b"])
    assert len(index) == 1 and index.lookup("b") is None and index.free_slots == 2
    assert kept not in {index.allocate("x"), index.allocate("y")} and index.allocate("z") is None
    index.drop("b")
    assert index.allocate("z") == kept


class _MruPolicy:
    """A policy written against the protocol alone: evicts the most recently admitted key."""

    def __init__(self, capacity: int) -> None:
        self.order: list = []

    def miss(self, key) -> None:
        return

    def insert(self, key) -> None:
        self.order.append(key)

    def remove(self, key) -> None:
        if key in self.order:
            self.order.remove(key)

    def hit(self, key) -> None:
        return

    def victim(self, evictable):
        return next((k for k in reversed(self.order) if evictable(k)), None)

    def evicted(self, key) -> None:
        self.remove(key)

    def clear(self) -> None:
        self.order.clear()


def test_a_new_eviction_policy_is_one_class_and_one_registration(monkeypatch):
    from pykv import tiers

    assert isinstance(tiers.LruPolicy(1), tiers.EvictionPolicy) and isinstance(tiers.ArcPolicy(1), tiers.EvictionPolicy)
    monkeypatch.setitem(tiers.EVICTION_POLICIES, "mru", _MruPolicy)
    index = DramIndex(2, "mru")
    fill(index, "a", "b")
    assert index.allocate("c") is not None
    assert index.take_evicted() == ["b"] and index.lookup("a") is not None


def test_the_dram_policy_setting_accepts_every_registered_policy():
    from pykv.config import PykvConfig
    from pykv.tiers import EVICTION_POLICIES

    for name in EVICTION_POLICIES:
        assert PykvConfig.from_extra_config({"root": "/t", "dram_policy": name}).dram_policy == name
