"""Device set records (``pykv/membership.py``): a device of another set, or a marker copied over a
device from another set, is refused by the engines and every command; sets grow and shrink; trees
without a record keep working (issue 36)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from mounts import bind  # noqa: F401  (fixture)
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.deviceset import DeviceSet
from pykv.errors import MembershipError
from pykv.membership import read_record
from pykv.tree import MARKER_NAME, SET_NAME, STATE_DIR, KVTree

FIELD = "kv_connector_extra_config.roots"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def dirs(tmp_path, *names):
    for name in names:
        (tmp_path / name).mkdir()
    return [tmp_path / name for name in names]


def record_of(root):
    return json.loads((root / STATE_DIR / SET_NAME).read_text())


def one_line(result, *words):
    assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.output
    for word in words:
        assert str(word) in result.stderr, result.stderr


def test_an_engine_records_its_set_on_every_device(tmp_path):
    a, b = dirs(tmp_path, "a", "b")
    devices = DeviceSet.create([a, b])
    ids = sorted(tree.identity for tree in devices)
    assert record_of(a) == {"tree_id": devices[0].identity, "members": ids}
    assert record_of(b) == {"tree_id": devices[1].identity, "members": ids}
    DeviceSet.create([a])  # one root: no record written, none needed
    assert record_of(a)["members"] == ids


def test_a_device_of_another_set_is_refused(tmp_path):
    a, b, c, e = dirs(tmp_path, "a", "b", "c", "e")
    DeviceSet.create([a, b])
    DeviceSet.create([c, e])
    shutil.copytree(c, tmp_path / "y", symlinks=True)  # a device of the other set, copied (rsync, dd)
    for roots in ([a, b, c], [a, b, tmp_path / "y"]):
        with pytest.raises(MembershipError, match=f"{FIELD}\\[0\\] and {FIELD}\\[2\\]: .* belong to different device sets"):
            DeviceSet.create(roots)
        one_line(run("fsck", *roots), "ROOT[0] and ROOT[2]", "different device sets")
        one_line(run("config", *(w for r in roots for w in ("--root", r))), "--root[0] and --root[2]")
    assert record_of(a)["members"] == record_of(b)["members"] != record_of(c)["members"]  # nothing rewritten


def test_a_marker_copied_from_another_set_is_refused(tmp_path):
    a, b, c, e = dirs(tmp_path, "a", "b", "c", "e")
    DeviceSet.create([a, b])
    DeviceSet.create([c, e])
    shutil.copy(c / MARKER_NAME, a / MARKER_NAME)  # the other set's marker over this set's device
    with pytest.raises(MembershipError, match=f"{FIELD}\\[0\\]: .* a marker copied from another device"):
        DeviceSet.create([a, b])
    for command in (["inspect", a], ["gc", "--max-size", "1G", a, b], ["fsck", a]):
        one_line(run(*command), "marker copied")
    one_line(run("config", "--root", a, "--root", b), "--root[0]: ", "marker copied")
    doctor = run("doctor", "--json", a)
    assert doctor.exit_code == 1, doctor.output
    tree = next(d for d in json.loads(doctor.stdout)["checks"] if d["item"] == "tree")
    assert tree["verdict"] == "fail" and "marker copied" in tree["detail"]


def test_a_new_marker_drops_the_old_record(tmp_path):
    """The advice for a copied tree: remove its marker, ``pykv init`` it: a new tree of no set yet."""
    a, b = dirs(tmp_path, "a", "b")
    DeviceSet.create([a, b])
    shutil.copytree(a, tmp_path / "copy", symlinks=True)
    (tmp_path / "copy" / MARKER_NAME).unlink()
    assert run("init", tmp_path / "copy").exit_code == 0
    assert not (tmp_path / "copy" / STATE_DIR / SET_NAME).exists()
    DeviceSet.create([a, b, tmp_path / "copy"])


def test_sets_grow_shrink_and_trees_without_a_record_keep_working(tmp_path):
    a, b, d, f = dirs(tmp_path, "a", "b", "d", "f")
    old = [KVTree.create(root, mkdir=False) for root in (a, b)]  # an older pykv: markers, no record
    assert all(read_record(tree) is None for tree in old)
    DeviceSet.open([a, b])  # a command reads, never writes
    assert all(read_record(tree) is None for tree in old)
    DeviceSet.create([a, b])  # the first engine writes it
    DeviceSet.create([a, b, d])  # a new device
    DeviceSet.create([a, b])  # removed again
    DeviceSet.create([a, d, f])  # d served with a once, f is new
    assert len(record_of(a)["members"]) == 3 and len(record_of(b)["members"]) == 2


@pytest.mark.parametrize("planted", ["garbage", "huge", "fifo", "link", "wrong_fields"])
def test_a_hostile_record_is_one_line(tmp_path, planted):
    a, b = dirs(tmp_path, "a", "b")
    DeviceSet.create([a, b])
    path = b / STATE_DIR / SET_NAME
    path.unlink()
    if planted == "garbage":
        path.write_bytes(b"\x00{not json")
    elif planted == "huge":
        path.write_text(json.dumps({"tree_id": "0" * 16, "members": ["0" * 16] * 10_000}))
    elif planted == "fifo":
        os.mkfifo(path)
    elif planted == "link":
        path.symlink_to(a / STATE_DIR / SET_NAME)
    else:
        path.write_text(json.dumps({"tree_id": "../../etc", "members": "all"}))
    with pytest.raises(MembershipError, match=f"{FIELD}|{path}"):
        DeviceSet.create([a, b])
    one_line(run("inspect", a, b), str(path), "remove it")


def test_fsck_takes_the_record_as_pykv_s_own(tmp_path):
    a, b = dirs(tmp_path, "a", "b")
    DeviceSet.create([a, b])
    result = run("fsck", "--json", a, b)
    assert result.exit_code == 0, result.output
    assert "set.json" not in result.stdout


def test_a_read_only_device_keeps_its_record_and_the_engine_starts(tmp_path, bind, caplog):
    """Engines with store=false use read-only mounts: a record that cannot be written is a warning."""
    a, b, disk = dirs(tmp_path, "a", "b", "disk")
    KVTree.create(disk, mkdir=False)
    read_only = bind(disk, tmp_path / "ro", read_only=True)
    devices = DeviceSet.create([a, b, read_only])
    assert len(devices) == 3 and not (disk / STATE_DIR / SET_NAME).exists()
    assert "could not record the device set" in caplog.text
