"""The break-even gate: the pure decision (pykv/calibration.py) and its use in PykvManager's lookups."""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace

import pytest

from pykv.calibration import (BreakEvenGate, Calibration, CalibrationError, TierCalibration, most_reusable,
                             reusable_prefix)

KEYS = [bytes([i]) * 36 for i in range(8)]


def tiers_of(mapping: dict[bytes, str]):
    return mapping.get


# -- pure ----------------------------------------------------------------------------------
def test_admits_at_or_above_the_tier_threshold():
    gate = BreakEvenGate({"disk": 1000, "dram": 0})
    assert not gate.admits(999, "disk") and gate.admits(1000, "disk") and gate.admits(5000, "disk")
    assert gate.admits(1, "dram")


def test_never_winning_tier_refuses_everything_and_unmeasured_tier_admits():
    gate = BreakEvenGate({"disk": math.inf})
    assert not gate.admits(10**9, "disk")
    assert gate.admits(1, "dram")  # not calibrated: no threshold


def test_margin_refuses_loads_just_above_the_threshold():
    gate = BreakEvenGate({"disk": 1000, "dram": 0, "never": math.inf}, margin=0.1)
    assert gate.threshold("disk") == pytest.approx(1100)
    assert not gate.admits(1000, "disk") and not gate.admits(1099, "disk") and gate.admits(1100, "disk")
    assert gate.admits(1, "dram") and not gate.admits(10**9, "never")


def test_nothing_to_load_is_never_a_refusal():
    gate = BreakEvenGate({"disk": math.inf})
    assert gate.admits(0, None) and gate.admits(0, "disk")


def test_reusable_prefix_stops_at_the_first_miss():
    where = {KEYS[0]: "disk", KEYS[1]: "disk", KEYS[3]: "disk"}
    assert reusable_prefix([(256, KEYS[:4])], 0, tiers_of(where)) == (512, "disk")
    assert reusable_prefix([(256, KEYS[:4])], 0, tiers_of({})) == (0, None)


def test_reusable_prefix_counts_from_the_computed_tokens():
    where = {k: "disk" for k in KEYS[:4]}
    assert reusable_prefix([(256, KEYS[:4])], 256, tiers_of(where)) == (768, "disk")
    assert reusable_prefix([(256, KEYS[:4])], 300, tiers_of(where)) == (724, "disk")  # mid-block: partial first
    assert reusable_prefix([(256, KEYS[:4])], 1024, tiers_of(where)) == (0, None)


def test_any_disk_block_makes_it_a_disk_load():
    dram_only = {k: "dram" for k in KEYS[:3]}
    assert reusable_prefix([(256, KEYS[:3])], 0, tiers_of(dram_only)) == (768, "dram")
    mixed = {**dram_only, KEYS[2]: "disk"}
    assert reusable_prefix([(256, KEYS[:3])], 0, tiers_of(mixed)) == (768, "disk")
    assert reusable_prefix([(256, KEYS[:3])], 512, tiers_of(mixed)) == (256, "disk")
    assert reusable_prefix([(256, KEYS[:3])], 0, tiers_of({**mixed, KEYS[1]: None})) == (256, "dram")


def test_reusable_prefix_is_cut_at_the_shortest_group():
    a, b = KEYS[:4], KEYS[4:8]
    where = {**{k: "dram" for k in a}, b[0]: "dram", b[1]: "dram"}
    # group b hits 2 blocks: only 512 tokens load, and a's third and fourth blocks do not decide the tier
    where[a[3]] = "disk"
    assert reusable_prefix([(256, a), (256, b)], 0, tiers_of(where)) == (512, "dram")


def test_decide_reports_tokens_and_tier():
    gate = BreakEvenGate({"disk": 600})
    where = {k: "disk" for k in KEYS[:3]}
    decision = gate.decide([(256, KEYS[:3])], 0, tiers_of(where))
    assert decision.admitted and (decision.hit_tokens, decision.tier) == (768, "disk")
    refused = gate.decide([(256, KEYS[:2])], 0, tiers_of(where))
    assert not refused.admitted and refused.hit_tokens == 512


# -- in the manager ------------------------------------------------------------------------
vllm = pytest.importorskip("vllm")

from pykv.connector import compat  # noqa: E402
from pykv.connector.compat import LookupResult, OffloadingConfig, ReqContext  # noqa: E402
from pykv.config import PykvConfig  # noqa: E402
from pykv.connector.identity import model_identity  # noqa: E402
from pykv.connector.manager import PykvManager  # noqa: E402
from pykv.connector.spec import Metric  # noqa: E402
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

CHUNK = 64  # 16 tokens per block x 4 blocks per chunk


def offloading_config(root: str, **extra) -> OffloadingConfig:
    os.makedirs(root, exist_ok=True)  # the tree's directory, as `pykv init` makes it: engines never create a root
    group = OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0)
    parallel = OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=False)
    return OffloadingConfig(groups=(group,), worker_kv_bytes_per_block=2 * 4096, enable_kv_cache_events=False,
                            extra_config={"root": root, "staging_bytes": "1M", **extra}, engine_id="e",
                            model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
                            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
                            parallel=parallel, kv_cache_layout="LBHNC")


ENGINE_MODEL = model_identity("tiny")  # what the namespace (and `pykv calibrate`) records for model "tiny"


def write_calibration(path, thresholds: dict[str, float], **identity) -> str:
    values = {"model": ENGINE_MODEL, "dtype": "bfloat16", "kv_layout": "LBHNC/v29+", **identity}
    Calibration(**values, tiers={t: TierCalibration(v) for t, v in thresholds.items()}).save(path)
    return str(path)


def manager(tmp_path, **extra) -> PykvManager:
    config = offloading_config(str(tmp_path / "tree"), **extra)
    return PykvManager(config, PykvConfig.from_extra_config(config.extra_config))


def on_disk(m: PykvManager, keys) -> None:
    for key in keys:
        path = m.devices[0].block_path(m.namespace.id, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


def in_dram(m: PykvManager, keys) -> None:
    for key in keys:
        assert m.dram.allocate(key) is not None
        m.dram.commit(key)


def lookups(m: PykvManager, req_id: str, keys) -> list[LookupResult]:
    context = ReqContext(req_id=req_id)
    return [m.lookup(k, context) for k in keys]


def test_no_file_no_gate(tmp_path):
    m = manager(tmp_path)
    assert m.gate is None
    on_disk(m, KEYS[:1])
    m.survey_request("r", [(CHUNK, KEYS[:1])], 0)
    assert lookups(m, "r", KEYS[:1]) == [LookupResult.HIT]
    assert Metric.GATE_REFUSALS not in m.counters


def test_short_prefix_is_refused_and_counted_long_one_loads(tmp_path):
    m = manager(tmp_path, dram_bytes="1M", breakeven_file=write_calibration(tmp_path / "cal.json", {"disk": 200}))
    on_disk(m, KEYS[:4])
    m.survey_request("short", [(CHUNK, KEYS[:3])], 0)  # 192 tokens < 200
    assert lookups(m, "short", KEYS[:3]) == [LookupResult.MISS] * 3
    assert lookups(m, "other", KEYS[:1]) == [LookupResult.HIT]  # another request is not affected
    assert m.counters[Metric.GATE_REFUSALS] == 1 and m.counters[Metric.GATE_REFUSED_TOKENS] == 192
    m.survey_request("long", [(CHUNK, KEYS[:4])], 0)  # 256 tokens
    assert lookups(m, "long", KEYS[:4]) == [LookupResult.HIT] * 4
    assert lookups(m, "short", KEYS[:1]) == [LookupResult.HIT]  # the refusal held for its own round only
    m.survey_request("long", [(CHUNK, KEYS[:4])], 64)  # a GPU prefix hit leaves 192 tokens to load
    assert lookups(m, "long", KEYS[1:4]) == [LookupResult.MISS] * 3
    assert m.counters[Metric.GATE_REFUSALS] == 2
    stats = m.get_stats()
    assert stats is not None


def test_lookups_after_an_admitted_gate_reuse_what_it_found(tmp_path, monkeypatch):
    m = manager(tmp_path, breakeven_file=write_calibration(tmp_path / "cal.json", {"disk": 100}))
    on_disk(m, KEYS[:3])
    stats = []
    contains = m.devices[0].contains
    monkeypatch.setattr(m.devices[0], "contains", lambda ns, key: stats.append(key) or contains(ns, key))
    m.survey_request("r", [(CHUNK, KEYS[:4])], 0)  # 3 blocks on disk, the 4th missing: 192 tokens >= 100
    assert stats == KEYS[:4]
    assert lookups(m, "r", KEYS[:4]) == [LookupResult.HIT] * 3 + [LookupResult.MISS]
    assert stats == KEYS[:4]  # no second look at the tree
    assert lookups(m, "other", KEYS[:1]) == [LookupResult.HIT] and stats == KEYS[:4] + KEYS[:1]
    (m.devices[0].block_path(m.namespace.id, KEYS[0])).unlink()  # gone since: the next round looks again
    m.survey_request("r", [(CHUNK, KEYS[:4])], 0)
    assert lookups(m, "r", KEYS[:1]) == [LookupResult.MISS]


def test_a_stored_prefix_is_surveyed_at_once_on_the_lookup_threads_and_lookups_reuse_it(tmp_path, monkeypatch):
    import threading

    from pykv.lanes import THREAD_PREFIX
    m = manager(tmp_path, dram_bytes="1M")  # no gate: the survey runs all the same
    keys = [bytes([i, 7]) * 18 for i in range(40)]
    on_disk(m, keys[:30])
    in_dram(m, keys[30:31])  # resident in DRAM: no stat for it
    stats, threads = [], set()
    contains = m.devices[0].contains

    def counted(ns, key):
        stats.append(key)
        threads.add(threading.current_thread().name)
        return contains(ns, key)
    monkeypatch.setattr(m.devices[0], "contains", counted)
    m.survey_request("r", [(CHUNK, keys)], 0)
    assert sorted(stats) == sorted(keys[:30] + keys[31:]) and len(stats) == 39
    assert any(name.startswith(THREAD_PREFIX) for name in threads)
    assert lookups(m, "r", keys[:32]) == [LookupResult.HIT] * 31 + [LookupResult.MISS]
    assert len(stats) == 39  # answered from the survey
    m.shutdown()
    assert m.presence.calls.threads_alive() == 0


def test_a_request_whose_first_block_misses_costs_one_stat_and_a_gpu_hit_skips_its_blocks(tmp_path, monkeypatch):
    m = manager(tmp_path)
    keys = [bytes([i, 9]) * 18 for i in range(20)]
    on_disk(m, keys[5:])
    stats = []
    contains = m.devices[0].contains
    monkeypatch.setattr(m.devices[0], "contains", lambda ns, key: stats.append(key) or contains(ns, key))
    m.survey_request("miss", [(CHUNK, keys)], 0)
    assert stats == [keys[0]] and lookups(m, "miss", keys[:1]) == [LookupResult.MISS]
    stats.clear()
    m.survey_request("gpu-hit", [(CHUNK, keys)], 5 * CHUNK)  # the first 5 blocks are in vLLM's GPU cache
    assert sorted(stats) == sorted(keys[5:])
    assert lookups(m, "gpu-hit", keys[5:]) == [LookupResult.HIT] * 15 and len(stats) == 15


def test_dram_and_disk_thresholds(tmp_path):
    m = manager(tmp_path, dram_bytes="1M", breakeven_file=write_calibration(tmp_path / "cal.json",
                                                                             {"disk": 1000, "dram": 100}))
    in_dram(m, KEYS[:2])
    on_disk(m, KEYS[2:3])
    m.survey_request("dram", [(CHUNK, KEYS[:2])], 0)  # 128 tokens from DRAM >= 100
    assert lookups(m, "dram", KEYS[:2]) == [LookupResult.HIT] * 2
    m.survey_request("mixed", [(CHUNK, KEYS[:3])], 0)  # 192 tokens, one block from disk: < 1000
    assert lookups(m, "mixed", KEYS[:3]) == [LookupResult.MISS] * 3


def test_a_request_shorter_than_every_threshold_is_refused_without_touching_the_tree(tmp_path, monkeypatch):
    m = manager(tmp_path, dram_bytes="1M", breakeven_file=write_calibration(tmp_path / "cal.json",
                                                                             {"disk": 1000, "dram": 150}))
    on_disk(m, KEYS[:3])
    stats = []
    contains = m.devices[0].contains
    monkeypatch.setattr(m.devices[0], "contains", lambda ns, key: stats.append(key) or contains(ns, key))
    m.survey_request("short", [(CHUNK, KEYS[:2])], 0)  # 128 tokens at most: below both thresholds
    assert stats == [] and lookups(m, "short", KEYS[:2]) == [LookupResult.MISS] * 2 and stats == []
    assert m.counters[Metric.GATE_REFUSALS] == 1 and m.counters[Metric.GATE_REFUSED_TOKENS] == 0
    m.survey_request("dram-long", [(CHUNK, KEYS[:3])], 0)  # 192 tokens could come from DRAM (>= 150): looked up
    assert stats[:1] == [KEYS[0]]
    assert lookups(m, "dram-long", KEYS[:3]) == [LookupResult.MISS] * 3  # on disk, 192 < 1000: refused after
    assert m.counters[Metric.GATE_REFUSALS] == 2 and m.counters[Metric.GATE_REFUSED_TOKENS] == 192
    stats.clear()
    m.survey_request("gpu-hit", [(CHUNK, KEYS[:3])], 2 * CHUNK)  # 64 tokens left to load: refused unlooked
    assert stats == [] and m.counters[Metric.GATE_REFUSALS] == 3
    m.survey_request("done", [(CHUNK, KEYS[:2])], 2 * CHUNK)  # nothing left to load: no refusal
    assert m.counters[Metric.GATE_REFUSALS] == 3


def test_without_a_dram_tier_a_request_shorter_than_the_disk_threshold_is_refused_unlooked(tmp_path, monkeypatch):
    """An engine without a DRAM tier can only load from disk: the DRAM threshold does not keep a
    request that no disk load would be admitted for from being looked up (a stat per block)."""
    cal = write_calibration(tmp_path / "cal.json", {"disk": 1000, "dram": 150})
    m = manager(tmp_path, breakeven_file=cal)  # no DRAM tier
    on_disk(m, KEYS[:3])
    stats = []
    contains = m.devices[0].contains
    monkeypatch.setattr(m.devices[0], "contains", lambda ns, key: stats.append(key) or contains(ns, key))
    m.survey_request("between", [(CHUNK, KEYS[:3])], 0)  # 192 tokens: above DRAM's 150, below disk's 1000
    assert stats == [] and lookups(m, "between", KEYS[:3]) == [LookupResult.MISS] * 3 and stats == []
    assert m.counters[Metric.GATE_REFUSALS] == 1 and m.counters[Metric.GATE_REFUSED_TOKENS] == 0
    m.shutdown()
    with_dram = manager(tmp_path / "b", dram_bytes="1M", breakeven_file=cal)  # the same request is looked up
    on_disk(with_dram, KEYS[:3])
    with_dram.survey_request("between", [(CHUNK, KEYS[:3])], 0)
    assert with_dram.counters[Metric.GATE_REFUSED_TOKENS] == 192
    with_dram.shutdown()
    long_keys = [bytes([i, 7]) * 18 for i in range(20)]
    m = manager(tmp_path / "c", breakeven_file=cal)
    on_disk(m, long_keys)
    m.survey_request("long", [(CHUNK, long_keys)], 0)  # 1,280 tokens >= 1000 (+ the 5 % margin): admitted
    assert lookups(m, "long", long_keys) == [LookupResult.HIT] * 20
    m.shutdown()


def test_the_survey_and_the_plan_leave_their_wall_clock_times_in_the_counter_file(tmp_path):
    import time
    m = manager(tmp_path)
    on_disk(m, KEYS[:3])
    began = time.time_ns()
    m.survey_request("r", [(CHUNK, KEYS[:3])], 0)
    m.prepare_load(KEYS[:3], ReqContext(req_id="r"))
    t = m.timing
    assert began <= t["survey_began_ns"] <= t["survey_ended_ns"] <= t["load_planned_ns"] <= time.time_ns()
    m.shutdown()


def test_disk_hits_are_stamped_in_the_background_after_prepare_load(tmp_path, monkeypatch):
    import threading
    m = manager(tmp_path)
    keys = [bytes([i, 3]) * 18 for i in range(20)]
    on_disk(m, keys)
    release, stamped = threading.Event(), []
    tree = m.devices[0]
    stamp = tree.stamp

    def slow_stamp(ns, key):
        assert release.wait(5)
        stamped.append(key)
        return stamp(ns, key)
    monkeypatch.setattr(tree, "stamp", slow_stamp)
    spec = m.prepare_load(keys, ReqContext(req_id="r"))
    assert len(spec.keys) == 20 and stamped == []  # returned before any stamp
    release.set()
    assert m.presence.close(timeout=5)  # the queued stamps run before the threads stop
    assert sorted(stamped) == sorted(keys)
    m.shutdown()


def test_an_unmeasured_tier_keeps_every_request_looked_up():
    gate = BreakEvenGate({"disk": 1000})  # DRAM not calibrated: any DRAM load is admitted
    assert not gate.refuses_any_load_of(10)
    gate = BreakEvenGate({"disk": 1000, "dram": 200}, margin=0.5)
    assert gate.refuses_any_load_of(299) and not gate.refuses_any_load_of(300)
    assert not gate.refuses_any_load_of(0)  # nothing to load: nothing refused
    assert BreakEvenGate({"disk": math.inf, "dram": math.inf}).refuses_any_load_of(10 ** 9)
    only_disk = BreakEvenGate({"disk": 1000, "dram": 200})
    assert not only_disk.refuses_any_load_of(500) and only_disk.refuses_any_load_of(500, tiers=("disk",))
    assert not only_disk.refuses_any_load_of(1000, tiers=("disk",))
    assert not BreakEvenGate({"dram": 200}).refuses_any_load_of(10, tiers=("disk",))  # disk not calibrated


def test_most_reusable_is_the_prefix_when_every_block_hits():
    assert most_reusable([(64, KEYS[:4])], 0) == 256
    assert most_reusable([(64, KEYS[:4])], 100) == 156  # from the first token not computed
    assert most_reusable([(64, KEYS[:4]), (32, KEYS[:5])], 0) == 160  # cut at the shortest group
    assert most_reusable([(64, KEYS[:2])], 200) == 0 and most_reusable([], 0) == 0
    tiers = tiers_of({k: "disk" for k in KEYS[:4]})
    assert reusable_prefix([(64, KEYS[:4])], 100, tiers)[0] == most_reusable([(64, KEYS[:4])], 100)


@pytest.mark.parametrize("content, field", [
    (None, r"\(file\): cannot read"), ("{oops", r"\(file\): malformed JSON"),
    ('{"pykv_calibration": 1, "model": "tiny", "dtype": "bfloat16", "tiers": {}}', "kv_layout: missing"),
    ('{"pykv_calibration": 1, "model": "tiny", "dtype": "bfloat16", "kv_layout": "LBHNC/v29+", '
     '"tiers": {"disk": {}}}', "tiers.disk.break_even_tokens: missing"),
])
def test_bad_file_stops_the_engine_naming_file_and_field(tmp_path, content, field):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CalibrationError, match=rf"^kv_connector_extra_config\.breakeven_file: {path}: {field}"):
        manager(tmp_path, breakeven_file=str(path))


@pytest.mark.parametrize("identity, field", [({"model": "other"}, "model"), ({"dtype": "float16"}, "dtype"),
                                             ({"kv_layout": "HND/v26-28"}, "kv_layout")])
def test_file_for_another_engine_refuses_to_start_unless_overridden(tmp_path, caplog, identity, field):
    path = write_calibration(tmp_path / "cal.json", {"disk": 100}, **identity)
    with pytest.raises(CalibrationError, match=rf"breakeven_file: {path}: {field}: calibrated for"):
        manager(tmp_path, breakeven_file=path)
    with caplog.at_level(logging.WARNING, logger="pykv"):
        m = manager(tmp_path, breakeven_file=path, breakeven_override="true")
    assert m.gate == BreakEvenGate({"disk": 100}, 0.05)  # breakeven_margin's default
    assert f"{field}: calibrated for" in caplog.text
    assert manager(tmp_path, breakeven_file=path, breakeven_override="true", breakeven_margin="0.25").gate.margin == 0.25


# -- the connector hook --------------------------------------------------------------------
def test_connector_hands_the_manager_vllms_keys_before_looking_up(monkeypatch):
    from pykv.connector.connector import PykvOffloadingConnector

    seen = []
    fake_manager = object.__new__(PykvManager)  # pykv's manager, its survey recorded
    fake_manager.survey_request = lambda *args: seen.append(args)
    group = SimpleNamespace(tokens_per_chunk=64, hashes_per_chunk=4, group_idx=3)
    connector = object.__new__(PykvOffloadingConnector)
    connector.connector_scheduler = SimpleNamespace(manager=fake_manager,
                                                    config=SimpleNamespace(kv_group_configs=[group]))
    monkeypatch.setattr(compat.OffloadingConnector, "get_num_new_matched_tokens",
                        lambda self, request, num_computed: (seen.append("super"), (0, False))[1])
    hashes = [bytes([i]) * 32 for i in range(10)]  # 10 hash blocks: 2 full chunks
    request = SimpleNamespace(request_id="r1", block_hashes=hashes)
    assert connector.get_num_new_matched_tokens(request, 16) == (0, False)
    expected = [compat.make_offload_key(hashes[3], 3), compat.make_offload_key(hashes[7], 3)]
    assert seen == [("r1", [(64, expected)], 16), "super"]
    seen.clear()
    connector.get_num_new_matched_tokens(request, 0)
    assert seen == [("r1", [(64, expected)], 0), "super"]
    # a manager that is not pykv's (another spec's): nothing before vLLM's lookups
    connector.connector_scheduler.manager = SimpleNamespace(survey_request=lambda *args: seen.append(args))
    seen.clear()
    connector.get_num_new_matched_tokens(request, 0)
    assert seen == ["super"]


def test_each_survey_counts_its_time_in_the_counter_file_not_in_vllms_stats(tmp_path):
    from pykv.counters import SchedulerCounter
    m = manager(tmp_path)
    on_disk(m, KEYS[:3])
    m.survey_request("r", [(CHUNK, KEYS[:3])], 0)
    m.survey_request("miss", [(CHUNK, [b"\x09" * 36])], 0)
    assert m.timing[SchedulerCounter.SURVEYS] == 2 and m.timing[SchedulerCounter.SURVEY_US] > 0
    assert SchedulerCounter.SURVEY_US not in m.counters  # vLLM's stats carry pykv:* metrics only
    assert SchedulerCounter.GATE_US not in m.timing  # no gate, no decisions
    gated = manager(tmp_path / "gated", breakeven_file=write_calibration(tmp_path / "cal.json", {"disk": 100}))
    on_disk(gated, KEYS[:3])
    gated.survey_request("r", [(CHUNK, KEYS[:3])], 0)
    assert SchedulerCounter.GATE_US in gated.timing  # counted (a decision may take under a microsecond)
    assert gated.timing[SchedulerCounter.GATE_US] <= gated.timing[SchedulerCounter.SURVEY_US]
