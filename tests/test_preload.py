"""``PreloadPlanner``: bounded look-ahead, shared prefixes, releases (scheduler side, pure)."""

from __future__ import annotations

import pytest

from pykv.preload import PreloadPlanner


def k(name: str) -> bytes:
    return name.encode().ljust(8, b".")


ON_DISK = {k(n) for n in ("a", "b", "c", "d", "e", "x", "y", "z")}


def tier_of(key: bytes) -> str | None:
    if key == k("m"):
        return "dram"
    return "disk" if key in ON_DISK else None


def test_plans_the_leading_run_of_disk_hits_only():
    planner = PreloadPlanner(look_ahead=4, max_blocks=100)
    planner.waiting("r1", [k("a"), k("m"), k("b"), k("nope"), k("c")])  # m: DRAM; nope: a miss
    plan = planner.plan(tier_of)
    assert plan.preloads == {"r1": (k("a"), k("b"))}  # c lies after the miss: vLLM would not load it
    assert planner.holds(k("a")) and not planner.holds(k("m")) and not planner.holds(k("c"))


def test_look_ahead_bounds_the_planned_requests_and_keeps_queue_order():
    planner = PreloadPlanner(look_ahead=2, max_blocks=100)
    for i, name in enumerate("xyz"):
        planner.waiting(f"r{i}", [k(name)])
    assert list(planner.plan(tier_of).preloads) == ["r0", "r1"]
    assert not planner.plan(tier_of)  # window full: nothing new, nothing released
    planner.remove("r0")  # scheduled
    plan = planner.plan(tier_of)
    assert plan.released == ("r0",) and list(plan.preloads) == ["r2"]


def test_shared_prefix_is_planned_once_and_reference_counted():
    planner = PreloadPlanner(look_ahead=4, max_blocks=3)
    for r in ("A", "B", "C"):
        planner.waiting(r, [k("a"), k("b"), k("c")])
    plan = planner.plan(tier_of)
    assert set(plan.preloads) == {"A", "B", "C"}  # all three fit: 3 distinct blocks
    assert planner.planned_blocks == 3
    planner.remove("A")
    planner.remove("B")
    assert planner.holds(k("a"))  # C still wants them
    planner.remove("C")
    assert not planner.holds(k("a")) and planner.planned_blocks == 0
    assert planner.plan(tier_of).released == ("A", "B", "C")


def test_max_blocks_bounds_speculative_blocks_and_later_requests_wait_for_room():
    planner = PreloadPlanner(look_ahead=8, max_blocks=3)
    planner.waiting("r1", [k("a"), k("b")])
    planner.waiting("r2", [k("a"), k("c"), k("d"), k("e")])  # one new block fits: c
    planner.waiting("r3", [k("x")])
    plan = planner.plan(tier_of)
    assert plan.preloads == {"r1": (k("a"), k("b")), "r2": (k("a"), k("c"))}
    assert planner.planned_blocks == 3 and "r3" not in plan.preloads
    planner.remove("r1")  # frees b
    assert planner.plan(tier_of).preloads == {"r3": (k("x"),)}


def test_a_request_that_leaves_before_planning_is_forgotten_silently():
    planner = PreloadPlanner(look_ahead=1, max_blocks=10)
    planner.waiting("r1", [k("a")])
    planner.waiting("r2", [k("b")])
    planner.remove("r2")  # aborted while beyond the look-ahead
    plan = planner.plan(tier_of)
    assert list(plan.preloads) == ["r1"] and plan.released == ()
    planner.remove("r1")  # finished
    assert planner.plan(tier_of).released == ("r1",)


def test_requests_with_nothing_on_disk_take_a_window_place_but_no_blocks():
    planner = PreloadPlanner(look_ahead=1, max_blocks=10)
    planner.waiting("cold", [k("nope")])
    planner.waiting("warm", [k("a")])
    assert not planner.plan(tier_of).preloads
    planner.remove("cold")
    plan = planner.plan(tier_of)
    assert plan.released == () and plan.preloads == {"warm": (k("a"),)}  # nothing to release for cold


def test_waiting_requests_are_bounded():
    planner = PreloadPlanner(look_ahead=1, max_blocks=10, max_waiting=2)
    assert planner.waiting("r1", [k("a")]) and planner.waiting("r2", [k("b")])
    assert planner.waiting("r3", [k("c")]) is False


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        PreloadPlanner(look_ahead=0, max_blocks=1)
