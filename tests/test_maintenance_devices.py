"""gc, fsck and inspect over a device set (several roots), library and CLI: several "devices" are
directories on one filesystem here."""

from __future__ import annotations

import json
import os

import pytest
from treefactory import BLOCK_SIZE, HOUR, NS, add_block, key, make_tree
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.deviceset import DeviceSet
from pykv.maintenance import fsck, fsck_devices, inspect_devices, last_gc, run_gc, run_gc_devices
from pykv.maintenance.placement import block_key, reachable
from pykv.maintenance.scan import Kind, Scan
from pykv.tree import KVTree


def run(*args, env=None):
    return CliRunner(env=env).invoke(app, [str(a) for a in args])


def make_set(tmp_path, count=4):  # four devices: each key has one that is not its candidate
    return DeviceSet([make_tree(tmp_path / f"dev{i}") for i in range(count)])


def placed(devices, count, start=0, **ages):
    """``count`` blocks, each on its first-choice device; their paths, in key order."""
    return [add_block(devices.tree_of(key(i)), key(i), **ages) for i in range(start, start + count)]


def off_placement(devices, i):
    """Block ``key(i)`` written on a device the set does not look on (none of its candidates)."""
    wrong = next(d for d in range(len(devices)) if d not in devices.candidates(key(i)))
    return add_block(devices[wrong], key(i)), wrong


def spread_ids(devices, per_device):
    """Key numbers in increasing order with ``per_device`` of them on each device."""
    ids, counts = [], [0] * len(devices)
    for i in range(10_000):
        if counts[devices.index_of(key(i))] < per_device:
            counts[devices.index_of(key(i))] += 1
            ids.append(i)
        if len(ids) == per_device * len(devices):
            break
    assert counts == [per_device] * len(devices)
    return ids


def blocks(tree):
    return {e.path for e in Scan.of(tree).of_kind(Kind.BLOCK)}


# -- placement ------------------------------------------------------------------------------------
def test_block_key_is_read_from_the_name(tmp_path):
    devices = make_set(tmp_path)
    path = add_block(devices[0], key(7))
    assert block_key(str(path)) == key(7) and block_key("/x/zz.kv") is None and block_key("/x/ab.tmp") is None
    choices = devices.candidates(key(7))
    assert all(reachable(devices, index, str(path)) for index in choices)
    assert not reachable(devices, ({0, 1, 2, 3} - set(choices)).pop(), str(path))
    assert reachable(DeviceSet([devices[0]]), 0, str(path))  # one device reaches everything


# -- gc: one limit over the set, one LRU order ----------------------------------------------------
def test_gc_limits_the_total_in_one_lru_order_across_devices(tmp_path):
    devices = make_set(tmp_path, 3)
    ids = spread_ids(devices, 4)  # 4 blocks on each device (the set's seeds are random per tree)
    paths = [add_block(devices.tree_of(key(i)), key(i), accessed_ago=(20 - n) * HOUR, published_ago=21 * HOUR)
             for n, i in enumerate(ids)]
    result = run_gc_devices(devices, 5 * BLOCK_SIZE)
    assert result.target_reached and result.freed_files == 7
    assert [e.path for e in result.deleted] == [str(p) for p in paths[:7]]  # oldest access first, any device
    assert set().union(*(blocks(t) for t in devices)) == {str(p) for p in paths[7:]}
    by_device = {d["root"]: d for d in result.devices}
    for index, tree in enumerate(devices):
        freed = [p for p in paths[:7] if devices.index_of(key(ids[paths.index(p)])) == index]
        assert by_device[str(tree.root)]["freed_files"] == len(freed)
        assert by_device[str(tree.root)]["freed_bytes"] == len(freed) * BLOCK_SIZE
        assert last_gc(tree)["remaining_bytes"] == 5 * BLOCK_SIZE  # every device records the set's gc


def test_gc_over_a_set_spares_young_blocks_and_keeps_unreachable_ones_in_lru_order(tmp_path):
    devices = make_set(tmp_path)
    young = placed(devices, 3, published_ago=60, accessed_ago=10 * HOUR)
    stray, _ = off_placement(devices, 50)  # unreachable, but accessed recently: not preferred
    old = placed(devices, 2, start=10, accessed_ago=5 * HOUR, published_ago=6 * HOUR)
    result = run_gc_devices(devices, 4 * BLOCK_SIZE, min_age_s=600)
    assert all(p.exists() for p in young) and stray.exists()
    assert not any(p.exists() for p in old) and result.target_reached


def test_gc_dry_run_over_a_set_deletes_and_records_nothing(tmp_path):
    devices = make_set(tmp_path)
    paths = placed(devices, 6)
    result = run_gc_devices(devices, 0, dry_run=True)
    assert result.freed_files == 6 and all(p.exists() for p in paths)
    assert all(last_gc(tree) is None for tree in devices)


# -- a set of one is its tree: run_gc_devices and fsck_devices answer as run_gc and fsck do ---------
def twin_trees(tmp_path):
    """Two trees with the same blocks, ages alike: 4 old ones (oldest access first) and 2 young."""
    trees = [make_tree(tmp_path / name) for name in ("one", "set")]
    for tree in trees:
        for i in range(4):
            add_block(tree, key(i), accessed_ago=(10 - i) * HOUR, published_ago=11 * HOUR)
        for i in range(4, 6):
            add_block(tree, key(i), published_ago=60, accessed_ago=20 * HOUR)
    return trees


def untimed(summary):
    return {k: v for k, v in summary.items() if k not in ("seconds", "finished_at")}


@pytest.mark.parametrize("limit, min_age_s, dry_run, use_catalog", [
    (3 * BLOCK_SIZE, 600, False, True),  # frees 3 of the old blocks
    (0, 600, False, False),  # the young blocks keep it over the limit
    (0, 0, True, True),  # a dry run frees nothing and records nothing
])
def test_gc_over_a_set_of_one_is_the_trees_gc(tmp_path, limit, min_age_s, dry_run, use_catalog):
    alone, member = twin_trees(tmp_path)
    expected = run_gc(alone, limit, min_age_s=min_age_s, dry_run=dry_run, use_catalog=use_catalog)
    result = run_gc_devices(DeviceSet([member]), limit, min_age_s=min_age_s, dry_run=dry_run,
                            use_catalog=use_catalog)
    assert untimed(result.summary()) == untimed(expected.summary()) and "devices" not in result.summary()
    assert result.devices == [] and result.target_reached == expected.target_reached
    assert [e.path[len(str(member.root)):] for e in result.deleted] == \
        [e.path[len(str(alone.root)):] for e in expected.deleted]
    assert {p[len(str(member.root)):] for p in blocks(member)} == {p[len(str(alone.root)):] for p in blocks(alone)}
    recorded = last_gc(member)
    assert (recorded is None) == dry_run and (recorded is None or untimed(recorded) == untimed(last_gc(alone)))
    assert (member.state_dir / "catalog.db").exists() == (alone.state_dir / "catalog.db").exists() == use_catalog


def test_fsck_over_a_set_of_one_is_the_trees_fsck(tmp_path):
    alone, member = twin_trees(tmp_path)
    for tree in (alone, member):
        os.truncate(tree.block_path(NS.id, key(1)), 100)
        (tree.root / "junk.txt").write_text("not pykv's")
    (report,) = fsck_devices(DeviceSet([member]))
    expected = fsck(alone).as_dict()
    assert report.device_id is None and "id" not in report.as_dict() and "unreachable_blocks" not in report.as_dict()
    assert {**report.as_dict(), "root": None} == {**expected, "root": None}


# -- fsck and inspect: per device, unreachable blocks reported, never removed -------------------
def test_fsck_reports_each_device_and_counts_unreachable_blocks(tmp_path):
    devices = make_set(tmp_path)
    placed(devices, 6)
    stray, wrong = off_placement(devices, 40)
    (devices[1].root / "junk.txt").write_text("not pykv's")
    reports = fsck_devices(devices)
    assert [r.root for r in reports] == [str(t.root) for t in devices]
    assert [r.unreachable_blocks for r in reports] == [1 if i == wrong else 0 for i in range(4)]
    assert reports[wrong].unreachable_bytes == BLOCK_SIZE and reports[wrong].as_dict()["id"] == devices[wrong].identity
    assert [r.clean for r in reports] == [True, False, True, True]  # the junk is a problem; the stray block is not
    assert sum(r.blocks_checked for r in reports) == 7 and stray.exists()


def test_inspect_devices_table_shares_and_unreachable(tmp_path):
    devices = make_set(tmp_path)
    placed(devices, 9)
    stray, wrong = off_placement(devices, 30)
    data = inspect_devices(devices).as_dict()
    assert data["roots"] == [str(t.root) for t in devices] and "root" not in data
    assert data["files"] == 10 and data["bytes"] == 10 * BLOCK_SIZE
    assert [d["id"] for d in data["devices"]] == [t.identity for t in devices]
    assert sum(d["blocks"] for d in data["devices"]) == 10
    assert sum(d["share"] for d in data["devices"]) == pytest.approx(1.0, abs=1e-3)
    assert [d["unreachable_blocks"] for d in data["devices"]] == [1 if i == wrong else 0 for i in range(4)]
    assert data["unreachable_blocks"] == 1 and stray.exists()
    assert data["namespaces"][0]["id"] == NS.id and data["namespaces"][0]["files"] == 10


# -- the CLI ------------------------------------------------------------------------------------
def test_cli_over_several_roots(tmp_path):
    devices = make_set(tmp_path)
    placed(devices, 9, accessed_ago=3 * HOUR, published_ago=4 * HOUR)
    stray, wrong = off_placement(devices, 30)
    roots = [t.root for t in devices]
    shown = run("inspect", *roots)
    assert shown.exit_code == 0, shown.output
    assert "identity" in shown.stdout and devices[wrong].identity in shown.stdout and "unreachable" in shown.stdout
    data = json.loads(run("inspect", *roots, "--json").stdout)
    assert data["files"] == 10 and data["unreachable_blocks"] == 1
    checked = run("fsck", *roots, "--json")
    assert checked.exit_code == 0, checked.output
    report = json.loads(checked.stdout)
    assert report["clean"] and report["unreachable_blocks"] == 1 and len(report["devices"]) == 4
    assert "device 2:" in run("fsck", *roots).stdout
    swept = run("gc", *roots, "--max-size", f"{4 * BLOCK_SIZE}", "--json")
    assert swept.exit_code == 0, swept.output
    result = json.loads(swept.stdout)
    assert result["remaining_bytes"] <= 4 * BLOCK_SIZE and len(result["devices"]) == 4
    assert sum(len(blocks(t)) for t in devices) == 4
    assert "unreachable" in run("gc", *roots, "--max-size", "1G").stdout


def test_cli_one_root_output_unchanged(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))
    for command in (["inspect"], ["fsck"], ["gc", "--max-size", "1G"]):
        data = json.loads(run(*command, tree.root, "--json").stdout)
        assert "devices" not in data and "roots" not in data and "id" not in data
    assert json.loads(run("inspect", tree.root, "--json").stdout)["root"] == str(tree.root)


@pytest.mark.parametrize("command", [["inspect"], ["fsck"], ["gc", "--max-size", "1G"]])
def test_cli_refuses_a_missing_device_in_one_line(tmp_path, command):
    devices = make_set(tmp_path, 2)
    result = run(*command, devices[0].root, tmp_path / "gone", devices[1].root)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("pykv: error: ROOT[1]: ")
    assert "gone" in result.stderr


@pytest.mark.parametrize("command", [["inspect"], ["fsck"], ["gc", "--max-size", "0"]])
def test_cli_refuses_overlapping_roots(tmp_path, command):
    devices = make_set(tmp_path, 2)
    placed(devices, 4)
    inner = KVTree.create(devices[0].root / "ab")  # a hex name: inside the first tree's layout
    for case in ([devices[0].root, devices[0].root], [devices[0].root, inner.root]):
        result = run(*command, *case)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "overlap" in result.stderr
    assert sum(len(blocks(t)) for t in devices) == 4  # gc deleted nothing
