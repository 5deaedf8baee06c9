from __future__ import annotations

import os

from treefactory import BLOCK_SIZE, HOUR, NS, add_block, key, make_tree

from pykv.maintenance.gc import collect, last_gc, plan_gc, run_gc
from pykv.maintenance.scan import Entry, Kind, Scan

NOW = 10**18
S = 10**9


def entry(name, *, size=100, atime_s=0, mtime_s=0, kind=Kind.BLOCK):
    return Entry(f"/x/{name}", kind, "ns", size, NOW - atime_s * S, NOW - mtime_s * S)


def blocks(tree):
    return sorted(e.path for e in Scan.of(tree).of_kind(Kind.BLOCK))


# -- the pure plan -----------------------------------------------------------------------------
def test_plan_orders_by_access_and_spares_young_blocks():
    entries = [entry("recent", atime_s=10, mtime_s=9000), entry("oldest", atime_s=5000, mtime_s=9000),
               entry("young", atime_s=9999, mtime_s=60), entry("middle", atime_s=100, mtime_s=9000),
               entry("temp", kind=Kind.TEMP, size=10**9)]
    plan = plan_gc(entries, max_size=250, min_age_s=600, now_ns=NOW)
    assert (plan.total_files, plan.total_bytes, plan.to_free) == (4, 400, 150)
    assert [e.path for e in plan.candidates] == ["/x/oldest", "/x/middle", "/x/recent"]
    assert (plan.young_files, plan.young_bytes) == (1, 100)
    assert [e.path for e in plan.victims()] == ["/x/oldest", "/x/middle"]


def test_plan_with_room_to_spare_frees_nothing():
    plan = plan_gc([entry("a"), entry("b")], max_size=1000, now_ns=NOW)
    assert plan.to_free == 0 and plan.victims() == []


# -- collect on real files ---------------------------------------------------------------------
def test_gc_deletes_oldest_access_first_until_the_tree_fits(tmp_path):
    tree = make_tree(tmp_path)
    paths = [add_block(tree, key(i), accessed_ago=(10 - i) * HOUR, published_ago=11 * HOUR) for i in range(10)]
    tree.touch(paths[0])  # the oldest access becomes the newest
    result = run_gc(tree, 6 * BLOCK_SIZE)
    assert result.target_reached and result.freed_files == 4 and result.freed_bytes == 4 * BLOCK_SIZE
    assert blocks(tree) == sorted(str(p) for p in [paths[0], *paths[5:]])
    assert [e.path for e in result.deleted] == [str(p) for p in paths[1:5]]
    assert sum(os.path.getsize(p) for p in blocks(tree)) <= 6 * BLOCK_SIZE


def test_young_blocks_survive_even_over_size(tmp_path):
    tree = make_tree(tmp_path)
    old = add_block(tree, key(1), published_ago=2 * HOUR)
    young = [add_block(tree, key(i), published_ago=60, accessed_ago=3 * HOUR) for i in range(2, 5)]
    result = run_gc(tree, BLOCK_SIZE, min_age_s=600)
    assert not old.exists() and all(p.exists() for p in young)
    assert not result.target_reached and result.young_files == 3
    assert result.remaining_bytes == 3 * BLOCK_SIZE


def test_dry_run_deletes_nothing(tmp_path):
    tree = make_tree(tmp_path)
    for i in range(4):
        add_block(tree, key(i))
    before = blocks(tree)
    result = run_gc(tree, 0, dry_run=True)
    assert result.freed_files == 4 and blocks(tree) == before
    assert last_gc(tree) is None


def test_a_block_deleted_by_someone_else_counts_as_freed(tmp_path):
    tree = make_tree(tmp_path)
    first = add_block(tree, key(1), accessed_ago=3 * HOUR)
    second = add_block(tree, key(2), accessed_ago=2 * HOUR)
    third = add_block(tree, key(3), accessed_ago=1 * HOUR)
    plan = plan_gc(Scan.of(tree).entries, 2 * BLOCK_SIZE)
    first.unlink()  # another host's gc, between scan and delete
    result = collect(plan)
    assert (result.vanished_files, result.freed_files) == (1, 0)
    assert result.target_reached and second.exists() and third.exists()


def test_a_block_touched_after_the_scan_is_requeued(tmp_path):
    tree = make_tree(tmp_path)
    first = add_block(tree, key(1), accessed_ago=3 * HOUR)
    second = add_block(tree, key(2), accessed_ago=2 * HOUR)
    plan = plan_gc(Scan.of(tree).entries, BLOCK_SIZE)
    tree.touch(first)  # a reader used it after the scan
    result = collect(plan)
    assert first.exists() and not second.exists() and result.freed_files == 1


def test_a_block_republished_after_the_scan_is_young_again(tmp_path):
    tree = make_tree(tmp_path)
    first = add_block(tree, key(1), accessed_ago=3 * HOUR)
    plan = plan_gc(Scan.of(tree).entries, 0)
    first.unlink()
    add_block(tree, key(1), published_ago=1)
    assert collect(plan).freed_files == 0 and first.exists()


def test_gc_records_its_outcome(tmp_path):
    tree = make_tree(tmp_path)
    for i in range(3):
        add_block(tree, key(i))
    run_gc(tree, BLOCK_SIZE)
    state = last_gc(tree)
    assert state["freed_files"] == 2 and state["freed_bytes"] == 2 * BLOCK_SIZE and state["target_reached"]
    assert state["freed_by_namespace"] == {NS.id: 2 * BLOCK_SIZE}
    assert [p.name for p in tree.state_dir.iterdir() if "gc.json" in p.name] == ["gc.json"]


def test_gc_through_a_warm_catalog_reads_fresh_atimes(tmp_path):
    from treefactory import age_dirs
    tree = make_tree(tmp_path)
    first = add_block(tree, key(1), accessed_ago=3 * HOUR)
    second = add_block(tree, key(2), accessed_ago=2 * HOUR)
    age_dirs(tree)
    run_gc(tree, 10 * BLOCK_SIZE)  # caches the atimes
    tree.touch(first)
    run_gc(tree, BLOCK_SIZE)
    assert first.exists() and not second.exists()
