from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time

import pytest
from treefactory import BLOCK_SIZE, HOUR, NS, OTHER_NS, add_block, key, make_tree, record_eviction
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.deviceset import DeviceSet
from pykv.maintenance import quarantine as quarantine_module
from pykv.maintenance.fsck import fsck, repair
from pykv.maintenance.gc import run_gc
from pykv.maintenance.inspect import AGE_BUCKETS, age_bucket, inspect_tree, summarize
from pykv.maintenance.quarantine import QuarantineUsage, quarantine_usage
from pykv.maintenance.scan import Entry, Kind
from pykv.tree import EVICT_RECORD_NAME

NOW = 10**18
S = 10**9


def test_age_buckets():
    assert [age_bucket(a) for a in (0, 599, 600, 3599, 86399, 86400 * 6, 86400 * 29, 86400 * 400)] == \
        ["<10m", "<10m", "<1h", "<1h", "<1d", "<7d", "<30d", ">=30d"]
    assert len(AGE_BUCKETS) == 6


def test_summarize_is_per_namespace():
    entries = [Entry("/a", Kind.BLOCK, "aa", 100, 0, NOW - 60 * S), Entry("/b", Kind.BLOCK, "aa", 50, 0, NOW - 2 * HOUR * S),
               Entry("/c", Kind.BLOCK, "bb", 500, 0, NOW), Entry("/d", Kind.TEMP, "aa", 7, 0, NOW - 100 * S),
               Entry("/e", Kind.FOREIGN, None, 1, 0, NOW), Entry("/f", Kind.METADATA, "aa", 300, 0, NOW)]
    summary = summarize("/root", entries, now_ns=NOW)
    assert [(s.id, s.files, s.bytes, s.temp_files) for s in summary.namespaces] == \
        [("bb", 1, 500, 0), ("aa", 2, 150, 1), ("", 0, 0, 0)]
    assert (summary.files, summary.bytes, summary.temp_files, summary.temp_bytes, summary.foreign) == (3, 650, 1, 7, 1)
    assert summary.oldest_temp_age_s == 100
    assert summary.ages["<10m"] == 2 and summary.ages["<1d"] == 1


def test_inspect_tree_reads_descriptions_and_last_gc(tmp_path):
    tree = make_tree(tmp_path, NS, OTHER_NS)
    for i in range(3):
        add_block(tree, key(i))
    add_block(tree, key(9), namespace=OTHER_NS, published_ago=40 * 86400)
    assert inspect_tree(tree).last_gc is None
    run_gc(tree, 3 * BLOCK_SIZE)
    summary = inspect_tree(tree)
    assert summary.files == 3 and summary.bytes == 3 * BLOCK_SIZE
    by_id = {s.id: s for s in summary.namespaces}
    assert by_id[NS.id].description == "test/model bfloat16 tp0/1 pp0 16 tokens/block"
    assert by_id[NS.id].fields["model"] == "test/model"
    assert summary.last_gc["freed_files"] == 1
    assert summary.as_dict()["namespaces"][0]["ages"]


def test_namespaces_that_read_alike_show_what_tells_them_apart(tmp_path):
    import dataclasses
    seeded = dataclasses.replace(NS, extra=(("block_hash_seed", "abc"), ("platform", "cpu")), label="/models/m")
    other_seed = dataclasses.replace(seeded, extra=(("block_hash_seed", "def"), ("platform", "cpu")))
    other_layout = dataclasses.replace(seeded, kv_layout="HND")
    tree = make_tree(tmp_path, seeded, other_seed, other_layout)
    for i, space in enumerate((seeded, other_seed, other_layout)):
        add_block(tree, key(i), namespace=space)
    by_id = {s.id: s for s in inspect_tree(tree).namespaces}
    assert by_id[seeded.id].description == "/models/m bfloat16 tp0/1 pp0 16 tokens/block seed abc kv_layout=NHD"
    assert by_id[other_layout.id].description.endswith("seed abc kv_layout=HND")
    assert by_id[other_seed.id].description == "/models/m bfloat16 tp0/1 pp0 16 tokens/block seed def"
    assert by_id[other_seed.id].fields["extra.platform"] == "cpu" and by_id[other_seed.id].fields["model"] == "test/model"


# -- the quarantine --------------------------------------------------------------------------------
def quarantined(tree, relative: str, size: int = 100):
    path = tree.state_dir / "quarantine" / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_the_quarantine_counts_regular_files_and_bytes_of_every_run_apart_from_the_namespaces(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))
    assert quarantine_usage(tree) == QuarantineUsage(0, 0)  # none yet: empty
    quarantined(tree, f"run1/{NS.id}/a5/00/a5000002.kv", 8192)
    quarantined(tree, "run2/notes.txt", 10)
    os.mkfifo(tree.state_dir / "quarantine" / "run2" / "fifo")  # never opened, not a file
    usage = quarantine_usage(tree)
    assert usage == QuarantineUsage(2, 8192 + 10)
    summary = inspect_tree(tree)
    assert summary.files == 1 and summary.foreign == 0 and summary.quarantine == usage
    assert summary.as_dict()["quarantine"] == {"files": 2, "bytes": 8192 + 10, "complete": True, "unreadable": 0}


def test_links_in_the_quarantine_are_never_followed(tmp_path):
    tree = make_tree(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    for i in range(5):
        (outside / f"big{i}").write_bytes(b"y" * 10_000)
    quarantined(tree, "run1/file", 100)
    (tree.state_dir / "quarantine" / "run1" / "link-to-dir").symlink_to(outside)
    (tree.state_dir / "quarantine" / "run1" / "link-to-file").symlink_to(outside / "big0")
    assert quarantine_usage(tree) == QuarantineUsage(1, 100)


@pytest.mark.parametrize("planted", [".pykv/quarantine", ".pykv"])
def test_a_planted_link_at_the_quarantine_is_reported_unreadable_not_followed(tmp_path, planted):
    tree = make_tree(tmp_path)
    outside = tmp_path / "outside"
    (outside / "quarantine" / "run").mkdir(parents=True)
    (outside / "quarantine" / "run" / "secret").write_bytes(b"s" * 10_000)
    if (tree.root / planted).exists():
        shutil.rmtree(tree.root / planted)
    (tree.root / planted).parent.mkdir(exist_ok=True)
    (tree.root / planted).symlink_to(outside / "quarantine" if planted.endswith("quarantine") else outside)
    with pytest.raises(OSError) as raised:  # the gauges' contract: unknown, not empty
        quarantine_usage(tree)
    assert raised.value.errno in (errno.ELOOP, errno.EXDEV)
    assert inspect_tree(tree).quarantine == QuarantineUsage(0, 0, complete=False, unreadable=1)
    result = invoke("inspect", tree.root, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["quarantine"] == {"files": 0, "bytes": 0, "complete": False, "unreadable": 1}
    shown = invoke("inspect", tree.root).stdout
    row = next(line for line in shown.splitlines() if line.startswith("quarantine"))
    assert "not served, 1" in row and "unreadable" in shown and "counted in part" in shown  # the row may wrap


def test_unreadable_entries_are_counted_not_fatal(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    quarantined(tree, "run1/locked/inside", 100)
    quarantined(tree, "run2/file", 100)
    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if path == "locked":
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(quarantine_module.os, "open", refusing)  # as root, chmod 000 would not refuse
    assert quarantine_usage(tree) == QuarantineUsage(1, 100, complete=False, unreadable=1)


def test_the_walk_is_bounded_in_entries_and_depth(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    for i in range(10):
        quarantined(tree, f"run/{i}", 1)
    usage = quarantine_usage(tree, limit=5)
    assert usage.files == 4 and not usage.complete  # "run" and four of its files
    monkeypatch.setattr(quarantine_module, "MAX_DEPTH", 3)
    quarantined(tree, "deep/a/b/c/d/file", 1)
    usage = quarantine_usage(tree)
    assert usage.files == 10 and not usage.complete  # the deep file lies below the bound


def test_a_directory_of_many_directories_holds_few_descriptors(tmp_path):
    import resource

    tree = make_tree(tmp_path)
    for i in range(300):
        quarantined(tree, f"run/{i}/file", 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))  # fewer than the directories
    try:
        assert quarantine_usage(tree) == QuarantineUsage(300, 300)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_inspect_shows_the_quarantine_in_its_table_and_json(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))
    quarantined(tree, "run1/a", 8192)
    quarantined(tree, "run1/b", 8192)
    shown = invoke("inspect", tree.root)
    assert shown.exit_code == 0, shown.output
    row = next(line for line in shown.stdout.splitlines() if line.startswith("quarantine"))
    assert [cell.strip() for cell in row.split("│")] == ["quarantine", ".pykv/quarantine, not served", "2",
                                                        "16.0 KiB", "-", "-"]
    data = json.loads(invoke("inspect", tree.root, "--json").stdout)
    assert data["quarantine"] == {"files": 2, "bytes": 16384, "complete": True, "unreadable": 0}
    assert data["files"] == 1  # not in the tree's counts


def test_inspect_of_a_device_set_gives_each_devices_quarantine(tmp_path):
    devices = DeviceSet([make_tree(tmp_path / f"dev{i}") for i in range(2)])
    quarantined(devices[1], "run/a", 4096)
    data = json.loads(invoke("inspect", *(t.root for t in devices), "--json").stdout)
    assert [d["quarantine"]["files"] for d in data["devices"]] == [0, 1]
    assert data["quarantine"] == {"files": 1, "bytes": 4096, "complete": True, "unreadable": 0}
    shown = invoke("inspect", *(t.root for t in devices)).stdout
    assert "quarantine by device: device 1: 1 file (4.0 KiB)" in shown


def test_fsck_says_what_the_quarantine_holds_after_a_repair(tmp_path):
    tree = make_tree(tmp_path)
    os.truncate(add_block(tree, key(1)), 4096)
    report = fsck(tree)
    assert report.quarantined == QuarantineUsage(0, 0)
    repair(tree, report)
    assert report.quarantined.files == 1 and report.as_dict()["quarantined"]["files"] == 1
    shown = invoke("fsck", tree.root)
    assert shown.exit_code == 0, shown.output
    assert f"quarantine: 1 file (4.0 KiB) in {tree.root}/.pykv/quarantine; kept until deleted by hand" in shown.stdout
    data = json.loads(invoke("fsck", tree.root, "--json").stdout)
    assert data["quarantined"] == {"files": 1, "bytes": 4096, "complete": True, "unreadable": 0}


def test_inspect_shows_eviction_never_healthy_behind_stuck_and_unreadable(tmp_path):
    tree = make_tree(tmp_path)
    assert "eviction: never (no engine with max_tree_bytes has run a round here)" in invoke("inspect", tree.root).output
    record_eviction(tree)
    healthy = invoke("inspect", tree.root)
    assert re.search(r"eviction: last round [5-7]s ago by vm, last success [5-7]s ago, 3.0 MiB of 4.0 MiB\n",
                     healthy.output)
    record_eviction(tree, behind=True, tree_bytes=5 << 20)
    assert "eviction: STUCK (behind: the last successful round left the device over its limit): " \
           in invoke("inspect", tree.root).output
    record_eviction(tree, at=time.time() - 1, ok_at=time.time() - 3 * 3600, error="[Errno 5] I/O error\x1b[2J")
    stuck = invoke("inspect", tree.root)
    assert "eviction: STUCK (no successful round for over 600 s): " in stuck.output
    assert "last success 3h ago" in stuck.output and "last error: [Errno 5] I/O error\\x1b[2J" in stuck.output
    [status] = json.loads(invoke("inspect", "--json", tree.root).stdout)["eviction"]
    assert (status["state"], status["stuck"], status["behind"]) == ("stuck", True, False)
    assert status["last_error"].startswith("[Errno 5] I/O error")
    assert status["last_success_age_s"] == pytest.approx(3 * 3600, abs=60) and status["threshold_s"] == 600.0
    (tree.state_dir / EVICT_RECORD_NAME).write_bytes(b'{"at": NaN}')
    bad = invoke("inspect", tree.root)
    assert bad.exit_code == 0 and "eviction: unreadable eviction record (not a record's fields and types)" in bad.output


def test_inspect_of_a_device_set_gives_each_devices_eviction(tmp_path):
    a, b = make_tree(tmp_path / "a"), make_tree(tmp_path / "b")
    record_eviction(b, behind=True)
    result = invoke("inspect", a.root, b.root)
    assert f"eviction device 0 ({a.root}): never" in result.output
    assert f"eviction device 1 ({b.root}): STUCK (behind" in result.output
    data = json.loads(invoke("inspect", "--json", a.root, b.root).stdout)
    assert [d["eviction"]["state"] for d in data["devices"]] == ["never", "stuck"]
