from __future__ import annotations

import os
import shutil
import time

import pytest

from hostile_leases import HOSTILE, check_outside_intact, plant, quarantined
from treefactory import HOUR, NS, OTHER_NS, add_block, key, make_tree, set_mtime

from pykv.format import HEADER_SIZE
from pykv.maintenance.evict_record import EvictRecord, read_record, record_round
from pykv.maintenance.fsck import Problem, fsck, repair
from pykv.maintenance.lease import Lease, read_lease
from pykv.maintenance.scan import Kind, Scan


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def plant_damage(tree, tmp_path):
    """Every class of damage, by path relative to the root -> expected problem."""
    rel = lambda p: os.path.relpath(p, tree.root)  # noqa: E731
    expected = {}
    sound = add_block(tree, key(0))

    old_temp = tree.temp_path(tree.block_path(NS.id, key(1)))
    old_temp.write_bytes(b"half written")
    set_mtime(old_temp, 2 * HOUR)
    expected[rel(old_temp)] = Problem.STALE_TEMP
    young_temp = tree.temp_path(tree.block_path(NS.id, key(2)))
    young_temp.write_bytes(b"being written")

    truncated = add_block(tree, key(3))
    os.truncate(truncated, HEADER_SIZE + 100)
    expected[rel(truncated)] = Problem.TRUNCATED
    oversized = add_block(tree, key(4))
    with open(oversized, "ab") as f:
        f.write(b"\0" * 4096)
    expected[rel(oversized)] = Problem.OVERSIZED
    empty = add_block(tree, key(5))
    os.truncate(empty, 0)
    expected[rel(empty)] = Problem.TRUNCATED
    bad_magic = add_block(tree, key(6))
    flip(bad_magic, 0)
    expected[rel(bad_magic)] = Problem.BAD_HEADER
    header_flip = add_block(tree, key(7))
    flip(header_flip, 45)  # inside the block key
    expected[rel(header_flip)] = Problem.BAD_HEADER
    payload_flip = add_block(tree, key(8))
    flip(payload_flip, HEADER_SIZE + 10)
    expected[rel(payload_flip)] = Problem.BAD_CHECKSUM

    wrong_name = tree.block_path(NS.id, key(9))
    tree.ensure_parent(wrong_name)
    shutil.copyfile(sound, wrong_name)
    expected[rel(wrong_name)] = Problem.MISPLACED
    tree.ensure_namespace(OTHER_NS)
    other = add_block(tree, key(10), namespace=OTHER_NS)
    wrong_namespace = tree.block_path(NS.id, key(10))
    tree.ensure_parent(wrong_namespace)
    shutil.copyfile(other, wrong_namespace)
    expected[rel(wrong_namespace)] = Problem.MISPLACED

    foreign = tree.root / NS.id / "notes.txt"
    foreign.write_text("hello")
    expected[rel(foreign)] = Problem.FOREIGN
    foreign_dir = sound.parent / "junk"
    foreign_dir.mkdir()
    (foreign_dir / "inside").write_text("x")
    expected[rel(foreign_dir)] = Problem.FOREIGN
    target = tmp_path / "precious"
    target.write_text("keep me")
    link = sound.parent / "ffff.kv"
    link.symlink_to(target)
    expected[rel(link)] = Problem.FOREIGN
    return expected, sound, young_temp, target


def test_fsck_finds_every_class_of_damage(tmp_path):
    tree = make_tree(tmp_path)
    expected, sound, young_temp, _ = plant_damage(tree, tmp_path)
    report = fsck(tree)
    assert {f.path: f.problem for f in report.findings} == expected
    assert report.blocks_checked == 10 and not report.clean
    assert report.counts == {"stale-temp": 1, "truncated": 2, "oversized": 1, "bad-header": 2,
                             "bad-checksum": 1, "misplaced": 2, "foreign": 3}


def test_repair_fixes_everything_and_keeps_symlink_targets(tmp_path):
    tree = make_tree(tmp_path)
    expected, sound, young_temp, target = plant_damage(tree, tmp_path)
    report = repair(tree, fsck(tree))
    assert report.clean and len(report.repaired) == len(expected) and report.failed == []
    assert target.read_text() == "keep me"
    assert sound.exists() and young_temp.exists()
    quarantined = {os.path.relpath(os.path.join(d, n), report.quarantine)
                   for d, dirs, files in os.walk(report.quarantine) for n in files}
    moved = {p for p, problem in expected.items() if problem.repair_action == "quarantine"}
    directories = {p for p in moved if p.endswith("junk")}  # moved whole, with what is inside
    assert (moved - directories) | {os.path.join(p, "inside") for p in directories} == quarantined
    assert sorted(f.path for f in report.moved) == sorted(moved)  # what it says it moved
    assert [f.path for f in report.deleted] == [p for p, pr in expected.items() if pr is Problem.STALE_TEMP]
    again = fsck(tree)
    assert again.clean and again.findings == [] and again.blocks_checked == 2
    assert str(sound) in [e.path for e in Scan.of(tree).of_kind(Kind.BLOCK)]


def test_young_temps_are_not_problems_until_grace_passes(tmp_path):
    tree = make_tree(tmp_path)
    temp = tree.temp_path(tree.block_path(NS.id, key(1)))
    tree.ensure_parent(temp)
    temp.write_bytes(b"x")
    set_mtime(temp, 120)
    assert fsck(tree).clean
    assert [f.problem for f in fsck(tree, grace_s=60).findings] == [Problem.STALE_TEMP]


def test_repair_tolerates_files_that_vanished(tmp_path):
    tree = make_tree(tmp_path)
    path = add_block(tree, key(1))
    os.truncate(path, 10)
    report = fsck(tree)
    path.unlink()
    assert repair(tree, report).clean


def test_repair_leaves_a_block_that_became_sound(tmp_path):
    tree = make_tree(tmp_path)
    path = add_block(tree, key(1))
    good = path.read_bytes()
    os.truncate(path, 10)
    report = fsck(tree)
    path.write_bytes(good)  # gc removed it, a writer republished it
    assert repair(tree, report).clean and path.exists()


BLOCK_FILE = HEADER_SIZE + 4096  # treefactory's blocks: a 2000-byte payload, padded


@pytest.mark.parametrize("cut, detail", [
    (0, "truncated: 0 of at least 4096 bytes (a header)"),
    (1, "truncated: 1 of at least 4096 bytes (a header)"),
    (100, "truncated: 100 of at least 4096 bytes (a header)"),
    (HEADER_SIZE // 2, f"truncated: {HEADER_SIZE // 2} of {BLOCK_FILE} bytes"),  # mid-header
    (HEADER_SIZE - 1, f"truncated: {HEADER_SIZE - 1} of {BLOCK_FILE} bytes"),
    (HEADER_SIZE, f"truncated: {HEADER_SIZE} of {BLOCK_FILE} bytes"),  # the header's end
    (HEADER_SIZE + 1000, f"truncated: {HEADER_SIZE + 1000} of {BLOCK_FILE} bytes"),  # mid-payload
    (BLOCK_FILE - 1, f"truncated: {BLOCK_FILE - 1} of {BLOCK_FILE} bytes"),  # one byte short
])
def test_a_cut_block_is_truncated_naming_its_size_and_the_headers(tmp_path, cut, detail):
    tree = make_tree(tmp_path)
    path = add_block(tree, key(1))
    assert os.path.getsize(path) == BLOCK_FILE
    os.truncate(path, cut)
    [finding] = fsck(tree).findings
    assert (finding.problem, finding.detail) == (Problem.TRUNCATED, detail)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_what_pykv_did_not_write_at_the_lease_name_is_found_and_moved_to_quarantine(tmp_path, case):
    tree = make_tree(tmp_path)
    add_block(tree, key(0))
    plant(tree, case, tmp_path / "outside")
    report = fsck(tree)
    [finding] = report.findings
    assert (finding.path, finding.problem) == (".pykv/evict.lease", Problem.FOREIGN) and not report.clean
    repaired = repair(tree, report)
    assert repaired.clean and repaired.moved == [finding] and len(quarantined(tree)) == 1
    assert fsck(tree).clean
    check_outside_intact(tree, tmp_path / "outside")


def test_the_cli_names_a_hard_linked_lease_and_repair_moves_it(tmp_path):
    from typer.testing import CliRunner
    from pykv.commands.app import app
    tree = make_tree(tmp_path)
    plant(tree, "hard-link", tmp_path / "outside")
    found = CliRunner().invoke(app, ["fsck", str(tree.root)])
    assert found.exit_code == 1
    assert "foreign       .pykv/evict.lease  (a file with 2 hard links, not a lease pykv wrote)" in found.output
    repaired = CliRunner().invoke(app, ["fsck", "--repair", str(tree.root)])
    assert repaired.exit_code == 0 and "moved    .pykv/evict.lease" in repaired.output
    assert len(quarantined(tree)) == 1 and CliRunner().invoke(app, ["fsck", str(tree.root)]).exit_code == 0


def test_repair_leaves_a_sound_lease_taken_since_the_check(tmp_path):
    tree = make_tree(tmp_path)
    plant(tree, "expiry-2100", tmp_path / "outside")
    report = fsck(tree)
    assert Lease(tree, "engine", ttl_s=30).acquire()  # an evictor took over (and quarantined it) meanwhile
    assert repair(tree, report).clean and read_lease(tree).holder == "engine" and len(quarantined(tree)) == 1


def test_a_sound_eviction_record_is_pykvs_and_a_bad_one_is_foreign_and_moved(tmp_path):
    tree = make_tree(tmp_path)
    now = time.time()
    record_round(tree, EvictRecord(now, now, False, 0, 1 << 20, 10.0, None, "engine"))
    assert fsck(tree).clean  # known: not foreign
    record = tree.state_dir / "evict.json"
    record.unlink()
    record.write_bytes(b'{"at": NaN, "junk": 1}')
    report = fsck(tree)
    [finding] = report.findings
    assert (finding.path, finding.problem) == (".pykv/evict.json", Problem.FOREIGN)
    assert finding.detail == "not a record's fields and types"
    repaired = repair(tree, report)
    assert [f.path for f in repaired.moved] == [".pykv/evict.json"] and not record.exists()
    assert [p.name for p in (tree.state_dir / "quarantine").glob("*/.pykv/*")] == ["evict.json"] and fsck(tree).clean


def test_repair_leaves_a_sound_record_written_since_the_check(tmp_path):
    tree = make_tree(tmp_path)
    tree.ensure_state_dir()
    os.mkfifo(tree.state_dir / "evict.json")
    report = fsck(tree)
    assert [f.detail for f in report.findings] == ["a FIFO, not a record pykv wrote"]
    record_round(tree, EvictRecord(time.time(), None, False, 0, 1 << 20, 10.0, "boom", "engine"))  # renamed over it
    assert repair(tree, report).clean and read_record(tree).error == "boom"
    assert not list((tree.state_dir / "quarantine").glob("*/.pykv/*"))
