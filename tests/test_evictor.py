"""In-engine eviction on real trees: down to the low-water mark, gc's safety, the lease, the counters."""

from __future__ import annotations

import errno
import logging
import math
import os
import time

import pytest
from hostile_leases import HOSTILE, check_outside_intact, plant, quarantined
from treefactory import BLOCK_SIZE, GEOMETRY, HOUR, NS, add_block, key, make_tree, set_mtime

from pykv.counters import Metric
from pykv.deviceset import DeviceSet
from pykv.failures import Step
from pykv.io.probe import open_backend
from pykv.maintenance.evict_record import EvictionState, EvictRecord, eviction_status, read_record
from pykv.maintenance.evictor import EvictionPolicy, TreeEvictor
from pykv.maintenance.gc import last_gc
from pykv.maintenance.lease import Lease
from pykv.maintenance.scan import Kind, Scan
from pykv.media import PosixMedium
from pykv.reactor import LoadBlock, Reactor, ReactorConfig
from pykv.staging import StagingPool, slot_bytes_for
from pykv.tree import KVTree

LIMIT = 10 * BLOCK_SIZE  # low water: 9 blocks


def policy(limit: int = LIMIT, min_age_s: float = 600.0) -> EvictionPolicy:
    return EvictionPolicy(limit, min_age_s, interval_s=3600.0)


def block_bytes(tree: KVTree) -> int:
    return sum(e.size for e in Scan.of(tree).of_kind(Kind.BLOCK))


def fill(tree: KVTree, count: int, *, published_ago: float = 2 * HOUR) -> list:
    """``count`` blocks, block ``i`` last accessed ``count - i`` minutes ago (0 is the least recent)."""
    return [add_block(tree, key(i), published_ago=published_ago, accessed_ago=(count - i) * 60) for i in range(count)]


def evictor(tree: KVTree, limit: int = LIMIT, min_age_s: float = 600.0) -> TreeEvictor:
    return TreeEvictor(DeviceSet([tree]), policy(limit, min_age_s))  # not started: tests call run_once


def test_a_tree_over_its_limit_goes_down_to_the_low_water_mark_least_recent_first(tmp_path, caplog):
    tree = make_tree(tmp_path)
    paths = fill(tree, 14)
    tree.touch(paths[0])  # the least recent becomes the most recent
    ev = evictor(tree)
    with caplog.at_level(logging.INFO, logger="pykv.maintenance.evictor"):
        [result] = ev.run_once()
    assert (result.before_bytes, result.after_bytes) == (14 * BLOCK_SIZE, 9 * BLOCK_SIZE)
    assert [p.exists() for p in paths] == [True] + [False] * 5 + [True] * 8
    assert block_bytes(tree) == 9 * BLOCK_SIZE <= policy().low_water
    assert ev.stats() == {Metric.EVICT_ROUNDS: 1, Metric.EVICTED_BLOCKS: 5, Metric.EVICTED_BYTES: 5 * BLOCK_SIZE}
    assert not ev.behind and not (tree.state_dir / "evict.lease").exists()
    assert last_gc(tree)["freed_files"] == 5  # recorded like any gc
    [line] = [r.getMessage() for r in caplog.records]
    assert f"{tree.root}: 5 blocks, 40.0 KiB freed" in line
    assert "112.0 KiB -> 72.0 KiB (limit 80.0 KiB, low water 72.0 KiB)" in line


def test_a_tree_within_its_limit_is_left_alone(tmp_path):
    tree = make_tree(tmp_path)
    paths = fill(tree, 10)  # exactly the limit: above the low-water mark, but no round is due
    ev = evictor(tree)
    [result] = ev.run_once()
    assert result.after_bytes == 10 * BLOCK_SIZE and all(p.exists() for p in paths)
    assert ev.stats() == {Metric.EVICT_ROUNDS: 1}


def test_young_blocks_are_never_evicted_and_make_the_evictor_behind_until_they_age(tmp_path):
    tree = make_tree(tmp_path)
    old = fill(tree, 4)
    young = [add_block(tree, key(100 + i), published_ago=5, accessed_ago=HOUR) for i in range(10)]
    ev = evictor(tree)
    [result] = ev.run_once()
    assert not any(p.exists() for p in old) and all(p.exists() for p in young)
    assert result.after_bytes == 10 * BLOCK_SIZE and result.young_bytes == 10 * BLOCK_SIZE
    add_block(tree, key(200), published_ago=5)
    [result] = ev.run_once()
    assert result.after_bytes == 11 * BLOCK_SIZE and ev.behind  # over the limit, nothing it may delete
    for p in young:
        set_mtime(p, 2 * HOUR)
    ev.run_once()
    assert not ev.behind and block_bytes(tree) <= policy().low_water


def test_what_pykv_did_not_create_is_never_evicted(tmp_path):
    tree = make_tree(tmp_path)
    paths = fill(tree, 14)
    junk = tree.block_path(NS.id, key(500))
    junk.write_bytes(b"not a block" * 2000)  # at a block's name, oldest of all
    set_mtime(junk, 3 * HOUR)
    os.link(paths[1], tmp_path / "outside")  # a block hard-linked from outside the tree
    foreign = tree.root / NS.id / "notes.txt"
    foreign.write_text("mine")
    [result] = evictor(tree).run_once()
    assert junk.exists() and foreign.read_text() == "mine" and (tmp_path / "outside").exists()
    # they count towards the size but are not pykv's to delete: real blocks make up for them
    assert [i for i, p in enumerate(paths) if p.exists()] == [1, 9, 10, 11, 12, 13]
    assert result.freed_files == 8 and result.after_bytes <= policy().low_water


def test_another_engines_lease_makes_the_round_a_counted_skip(tmp_path):
    tree = make_tree(tmp_path)
    paths = fill(tree, 14)
    other = Lease(tree, "other-engine", ttl_s=60)
    assert other.acquire()
    ev = evictor(tree)
    assert ev.run_once() == [None] and all(p.exists() for p in paths)
    assert ev.stats() == {Metric.EVICT_LEASE_SKIPS: 1}
    ev.note_stored(LIMIT)
    other.release()
    [result] = ev.run_once()
    assert result.freed_files == 5 and ev.stats()[Metric.EVICT_ROUNDS] == 1


def test_a_stale_lease_of_a_crashed_engine_does_not_stop_eviction(tmp_path):
    tree = make_tree(tmp_path)
    fill(tree, 14)
    assert Lease(tree, "crashed", ttl_s=60, clock=lambda: time.time() - HOUR).acquire()
    [result] = evictor(tree).run_once()
    assert result is not None and result.after_bytes <= policy().low_water


def test_a_failed_round_is_counted_and_never_raises(tmp_path, caplog):
    tree = make_tree(tmp_path)
    fill(tree, 14)
    tree.ensure_state_dir()
    os.rename(tree.state_dir, tmp_path / "elsewhere")
    tree.state_dir.symlink_to(tmp_path / "elsewhere")  # planted: never followed, so no lease can be taken
    ev = evictor(tree)
    with caplog.at_level(logging.WARNING):
        assert ev.run_once() == [None] and ev.run_once() == [None]
    assert ev.stats() == {Metric.EVICT_ERRORS: 2}
    [warning] = caplog.records  # the same failure again is not warned about every round
    assert f"eviction round on {tree.root} failed" in warning.getMessage()
    assert block_bytes(tree) == 14 * BLOCK_SIZE


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_round_moves_what_pykv_did_not_write_at_the_lease_name_to_quarantine_and_evicts(tmp_path, case, caplog):
    tree = make_tree(tmp_path)
    fill(tree, 14)
    plant(tree, case, tmp_path / "outside")
    ev = evictor(tree)
    with caplog.at_level(logging.WARNING):
        [result] = ev.run_once()
    assert result is not None and result.after_bytes <= policy().low_water == block_bytes(tree)
    assert ev.stats()[Metric.EVICT_ROUNDS] == 1 and not ev.behind
    [warning] = [r.getMessage() for r in caplog.records]  # one line: the file, what it is, where it went
    assert f"{tree.root}/.pykv/evict.lease: " in warning and "moved to quarantine" in warning
    assert len(quarantined(tree)) == 1 and not os.path.lexists(tree.state_dir / "evict.lease")  # released
    check_outside_intact(tree, tmp_path / "outside")


def test_the_limit_is_per_device(tmp_path):
    a, b = KVTree.create(tmp_path / "a"), KVTree.create(tmp_path / "b")
    for tree in (a, b):
        tree.ensure_namespace(NS)
    fill(a, 14)
    fill(b, 6)
    ev = TreeEvictor(DeviceSet([a, b]), policy())
    results = ev.run_once()
    assert [r.after_bytes for r in results] == [9 * BLOCK_SIZE, 6 * BLOCK_SIZE]


def test_each_round_feeds_its_devices_gauges_and_a_skipped_round_leaves_them(tmp_path):
    a, b = KVTree.create(tmp_path / "a"), KVTree.create(tmp_path / "b")
    for tree in (a, b):
        tree.ensure_namespace(NS)
    fill(a, 14)
    young = [add_block(b, key(100 + i), published_ago=5) for i in range(12)]  # too young to evict
    b.quarantine(young.pop(), "run")
    ev = TreeEvictor(DeviceSet([a, b]), policy())
    holder = Lease(a, "other-engine", ttl_s=60)
    assert holder.acquire()
    ev.run_once()  # device 0: skipped (another engine's lease); device 1: a round, still over
    holder.release()

    def values():
        return {(str(s.gauge), s.labels[0]): s.value for s in ev.gauges.samples()}

    assert math.isnan(values()[("pykv:tree_bytes", "0")]) and math.isnan(values()[("pykv:quarantine_files", "0")])
    assert values()[("pykv:tree_bytes", "1")] == 11 * BLOCK_SIZE and values()[("pykv:tree_blocks", "1")] == 11
    assert values()[("pykv:evict_behind", "1")] == 1.0 and ev.behind
    assert (values()[("pykv:quarantine_files", "1")], values()[("pykv:quarantine_bytes", "1")]) == (1, BLOCK_SIZE)
    ev.run_once()
    assert (values()[("pykv:tree_bytes", "0")], values()[("pykv:tree_blocks", "0")]) == (9 * BLOCK_SIZE, 9)
    assert values()[("pykv:evict_behind", "0")] == 0.0 and values()[("pykv:quarantine_files", "0")] == 0
    assert 0 <= values()[("pykv:evict_round_age_seconds", "0")] < 60


def test_note_stored_wakes_the_thread_and_close_stops_it(tmp_path):
    tree = make_tree(tmp_path)
    fill(tree, 14)
    ev = evictor(tree).start()  # interval: an hour; only the stored bytes can start a round
    try:
        ev.note_stored(policy().trigger_bytes)
        deadline = time.monotonic() + 30
        while not ev.stats().get(Metric.EVICT_ROUNDS) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ev.stats()[Metric.EVICTED_BLOCKS] == 5
    finally:
        ev.close()
    assert not ev._thread.is_alive()


@pytest.mark.parametrize("engine", ["io_uring", "threadpool"])
def test_a_reader_of_an_evicted_block_gets_a_miss_or_its_bytes_never_an_error(tmp_path, engine):
    """Eviction deletes blocks a reader is about to load (a miss: ENOENT, which the connector
    recomputes) and blocks a reader has open (the open file reads whole: unlink frees it later)."""
    tree = make_tree(tmp_path)
    paths = fill(tree, 14)
    opened = os.open(paths[1], os.O_RDONLY | os.O_NOATIME)  # (a plain read would make it recent)
    before = os.pread(opened, 2 * BLOCK_SIZE, 0)
    evictor(tree).run_once()
    assert not paths[0].exists() and not paths[1].exists()
    try:
        assert os.pread(opened, len(before) + 1, 0) == before
    finally:
        os.close(opened)
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 2)
    reactor = Reactor(open_backend(engine), pool, PosixMedium(tree), config=ReactorConfig(),
                      sink=_Drop(), source=None)
    reactor.sink.reactor = reactor
    try:
        reactor.read("l", [LoadBlock(paths[i], NS.fingerprint, key(i), GEOMETRY) for i in (0, 13)])
        result = reactor.wait_for("l", timeout=30)
    finally:
        reactor.close()
        pool.close()
    assert list(result.failed) == [0]
    failure = result.failed[0]
    assert (failure.step, failure.errno) == (Step.OPEN, errno.ENOENT) and failure.expected and not failure.corrupt


class _Drop:
    reactor: Reactor

    def deliver(self, blocks) -> None:
        for b in blocks:
            self.reactor.consumed(b.transfer)


def test_each_round_records_its_outcome_and_a_failed_one_keeps_the_last_success(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    fill(tree, 14)
    ev = evictor(tree)
    [result] = ev.run_once()
    ok = read_record(tree)
    assert isinstance(ok, EvictRecord) and ok.error is None and ok.ok_at == ok.at
    assert (ok.behind, ok.tree_bytes, ok.limit, ok.interval_s) == (False, result.after_bytes, LIMIT, 3600.0)
    assert ok.holder == ev.leases[0].holder

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error\nsecond line")

    monkeypatch.setattr("pykv.maintenance.evictor.scan_tree", broken)
    assert ev.run_once() == [None]
    failed = read_record(tree)
    assert failed.error == "[Errno 5] Input/output error second line" and failed.at >= ok.at
    assert (failed.ok_at, failed.tree_bytes, failed.behind) == (ok.ok_at, ok.tree_bytes, False)
    assert eviction_status(tree).state is EvictionState.OK  # one failure, within the threshold


def test_a_round_that_leaves_the_device_over_its_limit_records_it_behind(tmp_path):
    tree = make_tree(tmp_path)
    fill(tree, 14, published_ago=60)  # all younger than evict_min_age: nothing can go
    [result] = evictor(tree).run_once()
    record = read_record(tree)
    assert record.behind and record.tree_bytes == result.after_bytes == 14 * BLOCK_SIZE
    assert eviction_status(tree).state is EvictionState.STUCK


def test_a_round_skipped_for_another_engines_lease_records_nothing(tmp_path):
    tree = make_tree(tmp_path)
    fill(tree, 14)
    assert Lease(tree, "other", ttl_s=60).acquire()
    assert evictor(tree).run_once() == [None] and read_record(tree) is None
