"""BlockIndex (pykv/block_index.py): a request's survey, the gate's decision, lookups, load and store plans,
over a real DramResidency and a presence that answers from a table (no vLLM, torch or disk)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

from pykv.block_index import BlockIndex, StorePlan, StoreRefusal
from pykv.calibration.gate import BreakEvenGate
from pykv.counters import Metric, SchedulerCounter
from pykv.residency import DramResidency, Tier

CHUNK = 64  # tokens per storage block
KEYS = [bytes([i, 5]) * 18 for i in range(20)]


class TablePresence:
    """The disk as a table: key -> True (published), False (missing) or None (its device stalled);
    a key not in it is missing. Records every ``find`` and ``stamp``."""

    def __init__(self, table: dict[bytes, bool | None] | None = None) -> None:
        self.table = dict(table or {})
        self.asked: list[list[bytes]] = []
        self.stamped: list[bytes] = []

    def find(self, keys: Sequence[bytes]) -> list[bool | None]:
        self.asked.append(list(keys))
        return [self.table.get(key, False) for key in keys]

    def stamp(self, keys: Sequence[bytes]) -> int:
        self.stamped.extend(keys)
        return len(keys)

    @property
    def checks(self) -> list[bytes]:
        return [key for batch in self.asked for key in batch]


def index(on_disk=(), *, dram_slots: int = 0, in_dram=(), gate: BreakEvenGate | None = None,
          unknown=()) -> tuple[BlockIndex, TablePresence]:
    presence = TablePresence({**{k: True for k in on_disk}, **{k: None for k in unknown}})
    residency = DramResidency(dram_slots)
    for key in in_dram:
        assert residency.index.allocate(key) is not None
        residency.index.commit(key)
    return BlockIndex(residency, presence, gate), presence


def lookups(ix: BlockIndex, req_id: str, keys) -> list[bool]:
    return [ix.lookup(req_id, key) for key in keys]


# -- the survey ----------------------------------------------------------------------------
def test_the_survey_asks_the_first_block_alone_then_the_rest_at_once_and_lookups_reuse_it():
    ix, presence = index(KEYS[:10], dram_slots=4, in_dram=KEYS[10:11])
    assert ix.survey("r", [(CHUNK, KEYS[:12])], 0) is False
    assert presence.asked == [KEYS[:1], KEYS[1:10] + KEYS[11:12]]  # the DRAM hit needs no disk check
    assert lookups(ix, "r", KEYS[:12]) == [True] * 11 + [False]
    assert len(presence.asked) == 2  # answered from the survey
    assert lookups(ix, "other", KEYS[:1]) == [True] and len(presence.asked) == 3  # another request looks again
    assert ix.timing[SchedulerCounter.SURVEYS] == 1 and SchedulerCounter.GATE_US not in ix.timing
    assert ix.timing[SchedulerCounter.SURVEY_BEGAN_NS] <= ix.timing[SchedulerCounter.SURVEY_ENDED_NS]


def test_a_miss_at_the_first_block_costs_one_check():
    ix, presence = index(KEYS[1:10])
    ix.survey("r", [(CHUNK, KEYS[:10])], 0)
    assert presence.checks == [KEYS[0]]
    assert lookups(ix, "r", KEYS[:1]) == [False] and presence.checks == [KEYS[0]]


def test_blocks_vllm_already_has_are_not_surveyed():
    ix, presence = index(KEYS[5:10])
    ix.survey("r", [(CHUNK, KEYS[:10])], 5 * CHUNK)  # the first 5 blocks are in vLLM's GPU cache
    assert presence.checks == KEYS[5:10]
    assert lookups(ix, "r", KEYS[5:10]) == [True] * 5 and len(presence.checks) == 5


def test_a_block_whose_device_did_not_answer_is_a_miss():
    ix, _ = index(KEYS[:2] + KEYS[3:5], unknown=KEYS[2:3])
    ix.survey("r", [(CHUNK, KEYS[:5])], 0)
    assert lookups(ix, "r", KEYS[:5]) == [True, True, False, True, True]
    assert ix.tier_of(KEYS[2]) is None and not ix.on_disk(KEYS[2])
    stalled_first, _ = index(unknown=KEYS[:1])
    stalled_first.survey("r", [(CHUNK, KEYS[:3])], 0)
    assert lookups(stalled_first, "r", KEYS[:1]) == [False]


def test_a_new_survey_replaces_the_last_one():
    ix, presence = index(KEYS[:3])
    ix.survey("r", [(CHUNK, KEYS[:3])], 0)
    del presence.table[KEYS[0]]  # gone since: the next round looks again
    ix.survey("r", [(CHUNK, KEYS[:3])], 0)
    assert lookups(ix, "r", KEYS[:1]) == [False]


# -- the gate ------------------------------------------------------------------------------
def test_the_gate_refuses_a_short_prefix_and_counts_it_for_that_request_only():
    ix, _ = index(KEYS[:4], dram_slots=4, gate=BreakEvenGate({"disk": 200}))
    assert ix.survey("short", [(CHUNK, KEYS[:3])], 0) is True  # 192 tokens < 200
    assert ix.refused("short") and lookups(ix, "short", KEYS[:3]) == [False] * 3
    assert lookups(ix, "other", KEYS[:1]) == [True]
    assert ix.counters[Metric.GATE_REFUSALS] == 1 and ix.counters[Metric.GATE_REFUSED_TOKENS] == 192
    assert ix.survey("long", [(CHUNK, KEYS[:4])], 0) is False  # 256 tokens
    assert lookups(ix, "long", KEYS[:4]) == [True] * 4
    assert not ix.refused("short") and lookups(ix, "short", KEYS[:1]) == [True]  # held for its round only
    assert SchedulerCounter.GATE_US in ix.timing


def test_a_request_shorter_than_every_tier_threshold_is_refused_unlooked():
    gate = BreakEvenGate({"disk": 1000, "dram": 150})
    ix, presence = index(KEYS[:3], dram_slots=4, gate=gate)
    assert ix.survey("short", [(CHUNK, KEYS[:2])], 0)  # 128 tokens: below both
    assert presence.asked == [] and lookups(ix, "short", KEYS[:2]) == [False] * 2 and presence.asked == []
    assert ix.counters[Metric.GATE_REFUSED_TOKENS] == 0
    assert ix.survey("dram-long", [(CHUNK, KEYS[:3])], 0)  # could come from DRAM: looked up, then refused
    assert presence.checks[:1] == [KEYS[0]] and ix.counters[Metric.GATE_REFUSED_TOKENS] == 192
    disk_only, presence = index(KEYS[:3], gate=gate)  # no DRAM tier: only the disk's threshold counts
    assert disk_only.load_tiers == (Tier.DISK,)
    assert disk_only.survey("between", [(CHUNK, KEYS[:3])], 0) and presence.asked == []


def test_a_mixed_load_is_judged_by_the_disk_threshold():
    ix, _ = index(KEYS[2:3], dram_slots=4, in_dram=KEYS[:2], gate=BreakEvenGate({"disk": 1000, "dram": 100}))
    assert not ix.survey("dram", [(CHUNK, KEYS[:2])], 0)  # 128 tokens from DRAM >= 100
    assert ix.survey("mixed", [(CHUNK, KEYS[:3])], 0)  # one block from disk: 192 < 1000
    assert lookups(ix, "mixed", KEYS[:3]) == [False] * 3


# -- loads ---------------------------------------------------------------------------------
def test_a_load_plan_pins_dram_hits_stamps_disk_hits_and_answers_get_load_source():
    ix, presence = index(KEYS[1:3], dram_slots=4, in_dram=KEYS[:1])
    plan = ix.plan_load("r", KEYS[:3])
    assert plan.keys == tuple(KEYS[:3]) and plan.resident == (True, False, False)
    assert plan.slots[0] == ix.residency.slot_of(KEYS[0]) and ix.residency.index.entry(KEYS[0]).pins == 1
    assert None not in plan.slots[1:]  # promoted into pending slots
    assert presence.stamped == KEYS[1:3]
    assert ix.counters[Metric.HITS_DRAM] == 1 and ix.counters[Metric.HITS_DISK] == 2
    assert SchedulerCounter.LOAD_PLANNED_NS in ix.timing
    asked = len(presence.asked)
    assert [ix.load_source("r", k) for k in KEYS[:3]] == [Tier.DRAM, Tier.DISK, Tier.DISK]
    assert len(presence.asked) == asked  # as planned, no check
    assert ix.load_source("other", KEYS[1]) is Tier.DISK and len(presence.asked) == asked + 1  # looked up now
    ix.reset()
    assert ix.load_source("r", KEYS[0]) is Tier.DRAM  # forgotten plan: where it is now (still a DRAM hit)
    assert ix.load_source("r", KEYS[5]) is None


def test_without_a_dram_tier_a_disk_load_has_no_slot():
    ix, presence = index(KEYS[:2])
    plan = ix.plan_load("r", KEYS[:2])
    assert plan.slots == (None, None) and plan.resident == (False, False) and presence.stamped == KEYS[:2]


# -- stores --------------------------------------------------------------------------------
def test_a_store_plan_skips_blocks_in_dram_or_on_disk_and_asks_the_disk_once():
    ix, presence = index(KEYS[1:2], dram_slots=4, in_dram=KEYS[:1])
    plan = ix.plan_store(KEYS[:4])
    assert presence.asked == [KEYS[1:4]]  # the DRAM hit needs no disk check; the rest at once
    assert plan.keys == tuple(KEYS[2:4]) and plan.present == (KEYS[0], KEYS[1]) and plan.unanswered == ()
    assert None not in plan.slots and len(set(plan.slots)) == 2 and plan.refused is None
    assert all(ix.residency.holds(key) for key in KEYS[2:4])  # pinned, pending until the store completes
    assert ix.counters[Metric.STORE_SKIPPED] == 2 and Metric.STORES_UNANSWERED not in ix.counters


def test_blocks_being_stored_are_not_stored_again():
    ix, presence = index(dram_slots=0)
    assert ix.plan_store(KEYS[:2]).keys == tuple(KEYS[:2])
    again = ix.plan_store(KEYS[:3])
    assert again.keys == (KEYS[2],) and again.present == tuple(KEYS[:2]) and presence.asked[-1] == [KEYS[2]]
    assert ix.counters[Metric.STORE_SKIPPED] == 2


def test_a_block_whose_device_did_not_answer_is_not_stored():
    ix, _ = index(KEYS[:1], unknown=KEYS[1:2])
    plan = ix.plan_store(KEYS[:3])
    assert plan.keys == (KEYS[2],) and plan.present == (KEYS[0],) and plan.unanswered == (KEYS[1],)
    assert ix.counters[Metric.STORES_UNANSWERED] == 1 and ix.counters[Metric.STORE_SKIPPED] == 1
    assert not ix.residency.holds(KEYS[1])  # asked again at its next store


def test_without_a_free_dram_slot_a_block_is_still_stored_to_disk():
    ix, _ = index()  # no DRAM tier
    assert ix.plan_store(KEYS[:2]).slots == (None, None)
    full, _ = index(dram_slots=2)
    plan = full.plan_store(KEYS[:3])  # two slots, pinned by the first two stores
    assert plan.keys == tuple(KEYS[:3]) and None not in plan.slots[:2] and plan.slots[2] is None


def test_a_refused_store_writes_nothing_asks_nothing_and_counts_its_reason():
    ix, presence = index(dram_slots=4)
    for refusal, n in ((StoreRefusal.OFF, 2), (StoreRefusal.PAUSED, 3), (StoreRefusal.OVER_LIMIT, 1)):
        assert ix.plan_store(KEYS[:n], refusal) == StorePlan(refused=refusal)
    assert presence.asked == [] and len(ix.residency) == 0
    assert (ix.counters[Metric.STORES_OFF], ix.counters[Metric.STORES_DISABLED],
            ix.counters[Metric.STORES_OVER_LIMIT]) == (2, 3, 1)


def test_counts_go_to_the_counters_it_is_handed():
    from collections import Counter
    counters, timing = Counter(), Counter()
    ix = BlockIndex(DramResidency(0), TablePresence({KEYS[0]: True}), BreakEvenGate({"disk": 1000}),
                    counters=counters, timing=timing)
    ix.survey("r", [(CHUNK, KEYS[:2])], 0)
    assert ix.counters is counters and counters[Metric.GATE_REFUSALS] == 1 and timing[SchedulerCounter.SURVEYS] == 1


def test_the_block_index_imports_neither_vllm_nor_torch():
    code = "import sys, pykv.block_index; assert not {'vllm', 'torch'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
