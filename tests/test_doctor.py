"""``pykv doctor``: a verdict per item, probes that leave nothing behind, refusals (pykv/maintenance/doctor.py)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from treefactory import HOUR, add_block, key, make_tree, record_eviction, set_mtime
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.io.mounts import mount_of, parse_mountinfo
from pykv.io.uring import uring_available
from pykv.maintenance.doctor import ProbeRefused, Verdict, diagnose
from pykv.maintenance.fsck import Problem, fsck
from pykv.tree import EVICT_RECORD_NAME, MARKER_NAME, PROBE_NAME, temp_name

ITEMS = ["tree", "mount", "responsive", "stall_behaviour", "space", "eviction", "publish", "rename", "dir_fsync", "atime", "clock", "o_direct",
         "io_uring", "hash_seed", "other_clients"]
SEEDED = {"PYTHONHASHSEED": "0"}


def run(*args, env=None):
    return CliRunner(env=env).invoke(app, ["doctor", *(str(a) for a in args)])


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry below ``root`` with its size and mtime: what the probes must leave as it was."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


def test_a_tree_on_a_local_disk_passes_and_is_left_as_it_was(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(0))
    before = listing(tree.root)
    report = diagnose(tree.root, environ=SEEDED)
    assert [d.item for d in report.diagnoses] == ITEMS
    assert report.of("tree").verdict is Verdict.OK and tree.identity in report.of("tree").detail
    for item in ("publish", "rename", "dir_fsync", "atime", "clock", "o_direct", "space", "mount", "hash_seed",
                 "responsive"):
        assert report.of(item).verdict is Verdict.OK, report.of(item)
    assert report.of("io_uring").verdict is (Verdict.OK if uring_available()[0] else Verdict.WARN)
    assert report.of("other_clients").verdict is Verdict.SKIP
    assert not report.failed
    assert listing(tree.root) == before  # every probe file removed, nothing else touched


def test_cli_prints_one_line_per_item_and_exits_zero(tmp_path):
    tree = make_tree(tmp_path)
    result = run(tree.root, env=SEEDED)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [ln.split()[1] for ln in lines[:-1]] == ITEMS
    assert all(ln.split()[0] in ("ok", "warn", "fail", "skip") for ln in lines[:-1])
    assert lines[-1].startswith("ok: ") and "0 fail" in lines[-1]


def test_json_shape(tmp_path):
    tree = make_tree(tmp_path)
    result = run(tree.root, "--json", env=SEEDED)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"root", "verdict", "counts", "checks"}
    assert data["root"] == str(tree.root) and data["verdict"] in ("ok", "warn")
    assert [c["item"] for c in data["checks"]] == ITEMS
    assert all(set(c) == {"item", "verdict", "detail"} and c["detail"] for c in data["checks"])
    assert sum(data["counts"].values()) == len(ITEMS)
    assert data["counts"]["fail"] == 0


def test_hash_seed_unset_warns_set_is_ok(tmp_path):
    tree = make_tree(tmp_path)
    unset = diagnose(tree.root, environ={}).of("hash_seed")
    assert unset.verdict is Verdict.WARN and "PYTHONHASHSEED is unset" in unset.detail
    assert "PYTHONHASHSEED=7" in diagnose(tree.root, environ={"PYTHONHASHSEED": "7"}).of("hash_seed").detail


def test_an_empty_directory_is_probed_and_stays_empty(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    report = diagnose(empty, environ=SEEDED)
    assert report.of("tree").verdict is Verdict.WARN and "not a pykv tree yet" in report.of("tree").detail
    assert report.of("publish").verdict is Verdict.OK
    assert list(empty.iterdir()) == []


def test_a_directory_of_other_files_is_refused_untouched(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "thesis.tex").write_text("mine")
    before = listing(data)
    with pytest.raises(ProbeRefused, match="not a pykv tree and not empty"):
        diagnose(data)
    result = run(data)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("pykv: error: ") and "thesis.tex" in result.stderr
    assert listing(data) == before


def test_an_empty_directory_inside_a_tree_is_refused_untouched(tmp_path):
    """A namespace's new directory or an empty quarantine is no place to probe (issue 36)."""
    tree = make_tree(tmp_path)
    (tree.state_dir / "quarantine").mkdir(parents=True)
    before = listing(tree.root)
    for inside in (tree.state_dir / "quarantine", tree.state_dir):
        result = run(inside)
        assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.output
        assert f"lies inside the pykv tree {tree.root}" in result.stderr
    assert listing(tree.root) == before


def test_missing_path_and_file_are_refused(tmp_path):
    assert run(tmp_path / "nope").exit_code == 2
    (tmp_path / "file").write_text("x")
    result = run(tmp_path / "file")
    assert result.exit_code == 2 and "not a directory" in result.stderr


def test_an_unusable_marker_fails_and_exits_one(tmp_path):
    tree = make_tree(tmp_path)
    (tree.root / MARKER_NAME).write_text(json.dumps({"format_version": 99}))
    result = run(tree.root, "--json", env=SEEDED)
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["verdict"] == "fail"
    assert [c for c in data["checks"] if c["verdict"] == "fail"] == [
        {"item": "tree", "verdict": "fail", "detail": f"{tree.root / MARKER_NAME}: field format_version is 99, "
                                                       "this pykv needs 1"}]


def test_a_mount_without_hard_links_fails_publish(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    before = listing(tree.root)

    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "link", no_links)
    report = diagnose(tree.root, environ=SEEDED)
    publish = report.of("publish")
    assert publish.verdict is Verdict.FAIL and "hard link refused" in publish.detail
    assert report.failed
    assert listing(tree.root) == before


def test_a_link_that_replaces_the_published_file_fails(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    real_link = os.link

    def replacing_link(src, dst, **kwargs):  # a file system where link overwrites, like rename
        try:
            real_link(src, dst, **kwargs)
        except FileExistsError:
            os.unlink(dst, dir_fd=kwargs.get("dst_dir_fd"))
            real_link(src, dst, **kwargs)

    monkeypatch.setattr(os, "link", replacing_link)
    publish = diagnose(tree.root, environ=SEEDED).of("publish")
    assert publish.verdict is Verdict.FAIL and "second link" in publish.detail


def test_an_atime_that_does_not_stick_warns(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    monkeypatch.setattr(os, "utime", lambda *args, **kwargs: None)  # a mount that ignores explicit times
    atime = diagnose(tree.root, environ=SEEDED).of("atime")
    assert atime.verdict is Verdict.WARN and "did not stick" in atime.detail


def test_a_read_only_mount_skips_every_probe_that_writes(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    before = listing(tree.root)
    real_statvfs = os.statvfs

    def read_only(path):
        st = real_statvfs(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail, st.f_files,
                                  st.f_ffree, st.f_favail, st.f_flag | os.ST_RDONLY, st.f_namemax))

    monkeypatch.setattr(os, "statvfs", read_only)
    report = diagnose(tree.root, environ=SEEDED)
    writing = ["publish", "rename", "dir_fsync", "atime", "clock", "o_direct", "io_uring"]
    assert [d.item for d in report.diagnoses if d.verdict is Verdict.SKIP] == [*writing, "other_clients"]
    assert report.of("mount").verdict is Verdict.WARN and "store=false" in report.of("mount").detail
    assert not report.failed and listing(tree.root) == before


@pytest.fixture
def shm_dir():
    if not os.path.isdir("/dev/shm") or mount_of("/dev/shm") is None or mount_of("/dev/shm").fstype != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    directory = Path(tempfile.mkdtemp(prefix="pykv-doctor-", dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory)


def test_tmpfs_warns_about_o_direct_and_reads_buffered(shm_dir):
    report = diagnose(shm_dir, environ=SEEDED)
    direct = report.of("o_direct")
    assert direct.verdict is Verdict.WARN and "tmpfs" in direct.detail and "buffered" in direct.detail
    assert report.of("mount").detail.startswith("tmpfs ")
    if uring_available()[0]:
        assert report.of("io_uring").verdict is Verdict.OK and "buffered" in report.of("io_uring").detail
        assert "io_engine=auto reads this mount through the thread pool" in report.of("io_uring").detail
    assert not report.failed and list(shm_dir.iterdir()) == []


def test_a_killed_doctors_probe_file_is_a_stale_temp_for_fsck(tmp_path):
    tree = make_tree(tmp_path)
    left = tree.root / temp_name(PROBE_NAME)
    left.write_bytes(b"first writer")
    set_mtime(left, 2 * HOUR)
    report = fsck(tree, grace_s=HOUR)
    assert [(f.problem, Path(f.path).name) for f in report.findings] == [(Problem.STALE_TEMP, left.name)]


MOUNTINFO = """\
22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
40 22 0:35 / /mnt/nfs\\040share rw,relatime shared:5 - nfs4 srv:/export rw,vers=4.2,nocto,lookupcache=pos
41 22 0:36 / /mnt/nfs\\040share/deeper rw,noatime - fuse.juicefs JuiceFS:vol rw,user_id=0
garbage line
"""


def test_mountinfo_parsing_and_the_mount_of_a_path(tmp_path):
    mounts = parse_mountinfo(MOUNTINFO)
    assert [m.mount_point for m in mounts] == ["/", "/mnt/nfs share", "/mnt/nfs share/deeper"]
    nfs = mounts[1]
    assert nfs.fstype == "nfs4" and nfs.option("nocto") == "" and nfs.option("lookupcache") == "pos"
    assert nfs.option("actimeo") is None and nfs.network and not mounts[0].network
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert mount_of("/mnt/nfs share/tree", str(info)).fstype == "nfs4"
    assert mount_of("/mnt/nfs share/deeper/tree", str(info)).fstype == "fuse.juicefs"
    assert mount_of("/mnt/nfs sharex", str(info)).fstype == "ext4"
    assert mount_of("/", str(tmp_path / "missing")) is None


def test_clock_agrees_on_a_local_disk_and_a_skew_warns(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    assert diagnose(tree.root, environ=SEEDED).of("clock").verdict is Verdict.OK
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 120)  # this host's clock two minutes ahead
    clock = diagnose(tree.root, environ=SEEDED).of("clock")
    assert clock.verdict is Verdict.WARN and "-120 s off" in clock.detail


def test_nfs_without_close_to_open_consistency_warns(tmp_path, monkeypatch):
    from pykv.maintenance import doctor
    tree = make_tree(tmp_path)
    nfs, juicefs = parse_mountinfo(MOUNTINFO)[1:]
    monkeypatch.setattr(doctor, "mount_of", lambda root: nfs)
    mount = diagnose(tree.root, environ=SEEDED).of("mount")
    assert mount.verdict is Verdict.WARN and "nocto" in mount.detail and mount.detail.startswith("nfs4 srv:/export")
    monkeypatch.setattr(doctor, "mount_of", lambda root: juicefs)
    mount = diagnose(tree.root, environ=SEEDED).of("mount")
    assert mount.verdict is Verdict.OK and mount.detail.endswith("shared between nodes")


def test_eviction_healthy_never_behind_stuck_and_unreadable(tmp_path):
    tree = make_tree(tmp_path)
    never = run(tree.root, env=SEEDED)
    assert never.exit_code == 0 and "ok    eviction       never (no engine with max_tree_bytes" in never.output
    record_eviction(tree)
    healthy = run(tree.root, env=SEEDED)
    assert re.search(r"ok    eviction       last round [5-7]s ago by vm, last success [5-7]s ago, 3.0 MiB of 4.0 MiB\n",
                     healthy.output)
    record_eviction(tree, behind=True, tree_bytes=5 << 20)
    behind = run(tree.root, env=SEEDED)
    assert behind.exit_code == 0 and "warn  eviction       STUCK (behind: " in behind.output
    record_eviction(tree, at=time.time() - 2, ok_at=time.time() - 2 * HOUR, error="[Errno 28] No space left on device")
    stuck = run(tree.root, "--json", env=SEEDED)
    [check] = [c for c in json.loads(stuck.stdout)["checks"] if c["item"] == "eviction"]
    assert check["verdict"] == "warn" and check["detail"].startswith("STUCK (no successful round for over 600 s)")
    assert check["detail"].endswith("last error: [Errno 28] No space left on device")
    (tree.state_dir / EVICT_RECORD_NAME).unlink()
    os.mkfifo(tree.state_dir / EVICT_RECORD_NAME)  # never opened: doctor would hang
    bad = run(tree.root, env=SEEDED)
    assert bad.exit_code == 0
    assert "warn  eviction       unreadable eviction record (a FIFO, not a record pykv wrote)" in bad.output
