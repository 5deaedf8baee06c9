"""The values behind pykv's gauges, without vLLM: start values, rounds, ages, quarantine counts."""

from __future__ import annotations

import errno
import math
import os

import pytest
from treefactory import BLOCK_SIZE, add_block, key, make_tree

from pykv.counters import Gauge, Metric, prometheus_names
from pykv.maintenance.gauges import DeviceGauges, start_samples
from pykv.maintenance.quarantine import QuarantineUsage, quarantine_usage


def by_name(samples) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(str(s.gauge), s.labels): s.value for s in samples}


def test_every_gauge_of_every_device_has_a_start_value_and_its_labels():
    samples = start_samples(["/nvme0/kv", "/nvme1/kv"], 500 << 30)
    assert {(s.gauge, s.labels[0]) for s in samples} == {(g, d) for g in Gauge for d in ("0", "1")}
    assert all(len(s.labels) == len(s.gauge.labelnames) for s in samples)
    values = by_name(samples)
    assert values[("pykv:device_info", ("1", "/nvme1/kv"))] == 1.0
    assert values[("pykv:tree_limit_bytes", ("0",))] == 500 << 30
    assert values[("pykv:evict_behind", ("0",))] == 0.0  # known: stores do not pause at start
    unknown = [g for g in Gauge if g not in (Gauge.DEVICE_INFO, Gauge.TREE_LIMIT_BYTES, Gauge.EVICT_BEHIND)]
    assert all(math.isnan(values[(str(g), ("1",))]) for g in unknown)  # not measured yet


def test_prometheus_names_are_the_counters_total_samples_and_the_gauges():
    names = prometheus_names()
    assert "pykv:load_hits_disk_total" in names and "pykv:tree_bytes" in names and "pykv:stored_blocks_total" in names
    assert len(names) == len(Metric) + len(Gauge) and all(isinstance(n, str) and type(n) is str for n in names)


def test_a_round_sets_its_device_and_its_age_grows_from_the_rounds_end():
    now = [100.0]
    gauges = DeviceGauges(2, clock=lambda: now[0])
    gauges.round_done(1, blocks=7, nbytes=7 * BLOCK_SIZE, behind=True)
    gauges.quarantine_counted(1, QuarantineUsage(2, 3 * BLOCK_SIZE))
    now[0] = 112.5
    values = by_name(gauges.samples())
    assert values[("pykv:tree_blocks", ("1",))] == 7 and values[("pykv:tree_bytes", ("1",))] == 7 * BLOCK_SIZE
    assert values[("pykv:evict_behind", ("1",))] == 1.0 and values[("pykv:evict_round_age_seconds", ("1",))] == 12.5
    assert (values[("pykv:quarantine_files", ("1",))], values[("pykv:quarantine_bytes", ("1",))]) == (2, 3 * BLOCK_SIZE)
    assert math.isnan(values[("pykv:tree_bytes", ("0",))])  # no round on device 0 yet
    assert math.isnan(values[("pykv:evict_round_age_seconds", ("0",))])
    gauges.round_done(1, blocks=5, nbytes=5 * BLOCK_SIZE, behind=False)
    gauges.quarantine_counted(1, None)  # could not be counted: unknown again
    values = by_name(gauges.samples())
    assert values[("pykv:evict_behind", ("1",))] == 0.0 and values[("pykv:evict_round_age_seconds", ("1",))] == 0.0
    assert math.isnan(values[("pykv:quarantine_files", ("1",))])
    assert Gauge.DEVICE_INFO not in {s.gauge for s in gauges.samples()}  # static: set at start only


def test_the_quarantine_is_counted_in_files_and_bytes_wherever_it_nests(tmp_path):
    tree = make_tree(tmp_path)
    assert quarantine_usage(tree) == QuarantineUsage(0, 0)  # none yet: empty, not unknown
    paths = [add_block(tree, key(i)) for i in range(3)]
    tree.quarantine(paths[0], "run-1")
    tree.quarantine(paths[1], "run-2")
    assert quarantine_usage(tree) == QuarantineUsage(2, 2 * BLOCK_SIZE)
    outside = tmp_path / "big"
    outside.write_bytes(b"x" * 100_000)
    os.symlink(outside, tree.state_dir / "quarantine" / "run-1" / "link")  # never followed nor counted
    assert quarantine_usage(tree) == QuarantineUsage(2, 2 * BLOCK_SIZE)


def test_a_flooded_quarantine_is_counted_up_to_the_limit(tmp_path):
    tree = make_tree(tmp_path)
    flood = tree.state_dir / "quarantine" / "run"
    flood.mkdir(parents=True)
    for i in range(10):
        (flood / f"f{i}").write_bytes(b"")
    usage = quarantine_usage(tree, limit=5)
    assert not usage.complete and usage.files <= 5


def test_a_planted_link_at_the_quarantine_is_refused(tmp_path):
    tree = make_tree(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "run").mkdir(parents=True)
    (elsewhere / "run" / "f").write_bytes(b"x" * 4096)
    tree.ensure_state_dir()
    os.symlink(elsewhere, tree.state_dir / "quarantine")
    with pytest.raises(OSError) as raised:
        quarantine_usage(tree)
    assert raised.value.errno in (errno.ELOOP, errno.EXDEV)


def test_a_failing_device_keeps_its_last_rounds_age_growing_and_its_record_says_why(tmp_path, monkeypatch):
    from pykv.deviceset import DeviceSet
    from pykv.maintenance.evict_record import read_record
    from pykv.maintenance.evictor import EvictionPolicy, TreeEvictor
    tree = make_tree(tmp_path)
    add_block(tree, key(0))
    ev = TreeEvictor(DeviceSet([tree]), EvictionPolicy(10 * BLOCK_SIZE, 600.0, 3600.0))
    ev.run_once()
    [ended] = [s.value for s in ev.gauges.samples() if s.gauge is Gauge.EVICT_ROUND_AGE]

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("pykv.maintenance.evictor.scan_tree", broken)
    ev.run_once()
    [age] = [s.value for s in ev.gauges.samples() if s.gauge is Gauge.EVICT_ROUND_AGE]
    assert age >= ended  # not reset by a failed round: evict_round_age_seconds keeps growing while it fails
    assert read_record(tree).error == "[Errno 5] Input/output error"
