"""Every byte in the tree is hostile (issue 14): acting outside the root, the user's files,
reads that change recency, untrusted lengths and files, numbers and times, leaks, terminal.

Each test targets one defect class and failed on the code before the fix (see
docs/reliability.md). The adversarial matrix over places x kinds x names is in
``test_reliability_matrix.py``.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import xxhash
from typer.testing import CliRunner

from pykv.blockfile import check_block, encode_block, read_payload, write_block
from pykv.commands.app import app
from pykv.errors import FormatError, NotATreeError
from pykv.format import HEADER_SIZE, BlockHeader, Geometry, decode_header, encode_header
from pykv.maintenance import fsck, inspect_tree, repair, run_gc
from pykv.maintenance.catalog import Catalog
from pykv.tree import MARKER_NAME, NAMESPACE_FILE, KVTree

from reliability.deadline import deadline
from reliability.rig import NS, Rig, key_of, payload_of

GEOMETRY = Geometry(tokens=256, segments=2, segment_bytes=6000)
OLD_NS = 1_000_000_000 * 10**9  # 2001




def run(*argv: object):
    with deadline(30):
        return CliRunner().invoke(app, [str(a) for a in argv])


def tree_with_blocks(root: Path, count: int = 2) -> tuple[KVTree, list[Path]]:
    tree = KVTree.create(root)
    tree.ensure_namespace(NS)
    paths = []
    for i in range(count):
        write_block(tree, NS.id, key_of(i), GEOMETRY, payload_of(key_of(i), GEOMETRY.payload_length))
        paths.append(tree.block_path(NS.id, key_of(i)))
    return tree, paths


def age(path: Path, atime_ns: int = OLD_NS, mtime_ns: int = OLD_NS) -> None:
    os.utime(path, ns=(atime_ns, mtime_ns), follow_symlinks=False)


def one_error_line(result) -> bool:
    return (result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("pykv: error: ")
            and "Traceback" not in result.output)


# -- acting outside the tree ------------------------------------------------------------------

@pytest.mark.parametrize("link", [".pykv", ".pykv/quarantine"])
def test_a_symlinked_quarantine_moves_nothing_outside(tmp_path, link):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    paths[0].write_bytes(b"damaged")
    outside = tmp_path / "outside"
    outside.mkdir()
    if link != ".pykv":
        (tree.root / ".pykv").mkdir(exist_ok=True)
    (tree.root / link).symlink_to(outside)
    with pytest.raises(OSError) as raised:  # the worker's quarantine of a failed load calls exactly this
        tree.quarantine(paths[0], "load-host-1")
    assert raised.value.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR)
    result = run("fsck", tree.root, "--repair")
    assert "Traceback" not in result.output
    assert list(outside.iterdir()) == []  # nothing created or moved outside
    assert paths[0].read_bytes() == b"damaged"  # still in place: reported as not repaired
    assert result.exit_code == 1 and "could not repair" in result.output


def test_a_catalog_row_naming_a_path_outside_is_never_acted_on(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    victim = tmp_path / "victim.kv"
    victim.write_bytes(encode_block(NS.fingerprint, key_of(9), GEOMETRY, payload_of(key_of(9), 12000)))
    age(victim)
    leaf = paths[0].parent
    for path in paths:
        age(path)
    age(leaf)  # an old leaf dir mtime: the catalog trusts (reuses) its cached rows
    with Catalog(tree) as catalog:
        catalog.scan()
        rel = os.path.relpath(leaf, tree.root)
        assert catalog.db.execute("SELECT mtime_ns FROM leaf_dirs WHERE dir = ?", [rel]).fetchone()[0]
        escape = os.path.relpath(victim, leaf)  # ../../../../victim.kv
        catalog.db.execute("INSERT INTO entries VALUES (?, ?, 'block', 12288, ?, ?)", [rel, escape, OLD_NS, OLD_NS])
        catalog.db.conn.commit()
    result = run("gc", tree.root, "--max-size", "0", "--min-age", "0")
    assert result.exit_code in (0, 1), result.output
    assert victim.exists()
    assert not any(p.exists() for p in paths)  # the tree's own blocks went


def test_a_symlinked_namespace_dir_gets_no_namespace_json(tmp_path):
    tree = KVTree.create(tmp_path / "tree")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tree.root / NS.id).symlink_to(outside)
    with pytest.raises(OSError):
        tree.ensure_namespace(NS)
    assert list(outside.iterdir()) == []


# -- the user's files -------------------------------------------------------------------------

def test_an_engine_refuses_a_directory_of_files_that_is_not_a_tree(tmp_path):
    user = tmp_path / "home"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    with pytest.raises(NotATreeError, match=r"kv_connector_extra_config\.root") as refused:
        KVTree.create(user)  # what the connector's manager and worker call at engine start
    assert "pykv init" in str(refused.value)
    assert sorted(os.listdir(user)) == ["thesis.tex"]  # not marked
    KVTree.create(tmp_path / "new")  # a new directory and an empty one are fine
    (tmp_path / "empty").mkdir()
    KVTree.create(tmp_path / "empty")


def test_pykv_init_adopts_a_directory_and_fsck_repair_moves_never_deletes(tmp_path):
    user = tmp_path / "home"
    (user / "notes").mkdir(parents=True)
    (user / "thesis.tex").write_text("years of work")
    (user / "notes" / "a.txt").write_text("a")
    (user / "x.kv.tmp.mine").write_text("looks like a temp, is not pykv's")
    assert run("init", user).exit_code == 0
    KVTree.create(user)  # now a tree
    result = run("fsck", user, "--repair", "--grace", "0")
    assert result.exit_code == 0, result.output
    quarantine = next((user / ".pykv" / "quarantine").iterdir())
    assert (quarantine / "thesis.tex").read_text() == "years of work"
    assert (quarantine / "notes" / "a.txt").read_text() == "a"
    assert (quarantine / "x.kv.tmp.mine").exists()
    assert "deleted 0 stale temps" in result.stdout and "moved 3 entries" in result.stdout
    assert "moved    thesis.tex" in result.stdout


def test_a_stale_temp_hard_linked_from_outside_is_moved_not_deleted(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    precious = tmp_path / "precious"
    precious.write_text("mine")
    temp = paths[0].parent / f"{paths[0].name}.tmp.host.1.abcd"
    os.link(precious, temp)
    age(temp)
    own = paths[0].parent / f"{paths[1].name}.tmp.host.2.abcd"
    own.write_bytes(b"partial")
    age(own)
    report = repair(tree, fsck(tree, grace_s=0))
    assert [f.path for f in report.deleted] == [os.path.relpath(own, tree.root)]
    assert [f.path for f in report.moved] == [os.path.relpath(temp, tree.root)]
    assert not temp.exists() and os.stat(precious).st_nlink == 2  # the tree's link is in quarantine


def test_gc_never_deletes_a_block_linked_from_outside(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    backup = tmp_path / "backup.kv"
    os.link(paths[0], backup)
    for path in paths:
        age(path)
    result = run_gc(tree, 0, min_age_s=0)
    assert paths[0].exists() and not paths[1].exists()
    assert result.junk_files == 1 and result.freed_files == 1


# -- reads that change recency ------------------------------------------------------------------

@pytest.fixture
def strictatime(tmp_path):
    """A tmpfs mounted ``strictatime``: every read of a file moves its atime."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "strictatime,size=64m", "none", str(mount)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_the_mount_does_update_atimes(strictatime):
    probe = strictatime / "probe"
    probe.write_bytes(b"x")
    age(probe)
    probe.read_bytes()
    assert os.stat(probe).st_atime_ns != OLD_NS  # the control: a plain read moves it


@pytest.mark.parametrize("noatime_permitted", [True, False])
def test_maintenance_reads_do_not_change_recency(strictatime, monkeypatch, noatime_permitted):
    tree, paths = tree_with_blocks(strictatime / "tree", count=3)
    for path in paths:
        age(path)
    if not noatime_permitted:  # as for a file of another user: O_NOATIME -> EPERM, atime put back instead
        real_open = os.open

        def refusing(path, flags, *args, **kwargs):
            if flags & os.O_NOATIME:
                raise PermissionError(errno.EPERM, "O_NOATIME not permitted", path)
            return real_open(path, flags, *args, **kwargs)
        monkeypatch.setattr(os, "open", refusing)
    assert fsck(tree).clean
    check_block(paths[0])
    read_payload(paths[1])
    inspect_tree(tree)
    run_gc(tree, 10**12, min_age_s=0)
    assert [os.stat(p).st_atime_ns for p in paths] == [OLD_NS] * 3


# -- untrusted lengths and files ----------------------------------------------------------------

def header_bytes(payload_length: int, *, checksum: bytes = bytes(16), key: bytes = b"k" * 20) -> bytes:
    header = BlockHeader(NS.fingerprint, key, Geometry(256, 1, payload_length), checksum)
    return encode_header(header)


def test_a_header_claiming_a_terabyte_is_refused_before_any_allocation(tmp_path):
    path = tmp_path / "huge.kv"
    path.write_bytes(header_bytes(1 << 41))
    with pytest.raises(FormatError, match="truncated|more than"):
        read_payload(path)
    with pytest.raises(FormatError):
        check_block(path)


def test_a_sparse_terabyte_block_is_quarantined_by_fsck_repair(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    with open(paths[0], "r+b") as f:
        f.write(header_bytes((1 << 40) - HEADER_SIZE, key=key_of(0)))
        f.truncate(1 << 40)
    result = run("fsck", tree.root, "--repair")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert not paths[0].exists() and "moved 1 entry" in result.stdout


def test_a_block_over_2_gib_is_checked_in_pieces_not_called_truncated(tmp_path):
    length = (2 << 30) + 8192  # more than one pread returns
    hasher = xxhash.xxh3_128()
    zeros = bytes(64 << 20)
    done = 0
    while done < length:
        piece = min(len(zeros), length - done)
        hasher.update(zeros[:piece])
        done += piece
    path = tmp_path / "big.kv"
    with open(path, "wb") as f:
        f.write(header_bytes(length, checksum=hasher.digest()))
        f.truncate(HEADER_SIZE + length)  # sparse: zeros
    assert check_block(path).header.payload_length == length


def test_reserved_header_bytes_must_be_zero():
    raw = bytearray(header_bytes(4096))
    decode_header(bytes(raw))
    raw[36] = 1
    checksum = xxhash.xxh3_64_intdigest(bytes(raw[:152])).to_bytes(8, "little")
    raw[152:160] = checksum  # a valid header checksum over the set byte
    with pytest.raises(FormatError, match="reserved"):
        decode_header(bytes(raw))


@pytest.mark.parametrize("version", ["true", "1.0", '"1"', "[1]", "null"])
def test_the_marker_format_version_must_be_a_real_integer(tmp_path, version):
    root = tmp_path / "tree"
    root.mkdir()
    (root / MARKER_NAME).write_text(f'{{"format_version": {version}}}')
    with pytest.raises(NotATreeError, match="format_version"):
        KVTree.open(root)


@pytest.mark.parametrize("backend", ["threadpool", "io_uring"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_non_regular_file_at_a_block_name_fails_the_load_without_hanging(tmp_path, backend, kind):
    with Rig(tmp_path / "tree", backend=backend) as rig:
        if rig.reactor.backend.name != backend:
            pytest.skip(f"{backend} unavailable here")
        key = key_of(1)
        path = rig.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "directory":
            path.mkdir()
        else:
            os.mknod(path, 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero
        with deadline(20):
            outcome = rig.load([key], timeout=15)
        assert outcome.result is not None and 0 in outcome.result.failed, outcome


# -- numbers and times from outside --------------------------------------------------------------

def test_future_times_do_not_make_a_block_recent_forever(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree", count=3)
    future = (time.time_ns() + 80 * 365 * 86400 * 10**9)
    age(paths[0], atime_ns=future, mtime_ns=future)  # planted: "used in 2100, published in 2100"
    time.sleep(0.05)
    for path in paths[1:]:
        tree.touch(path)  # really used after the planting
    result = run_gc(tree, 2 * os.stat(paths[1]).st_size, min_age_s=0)
    assert result.freed_files == 1 and not paths[0].exists() and paths[1].exists() and paths[2].exists()


def test_a_sparse_terabyte_junk_file_never_empties_the_tree(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree", count=4)
    for path in paths:
        age(path)
    junk = paths[0].parent / f"{'ab' * 20}.kv"
    with open(junk, "wb") as f:
        f.truncate(1 << 40)
    age(junk)
    real = sum(os.stat(p).st_size for p in paths)
    result = run("gc", tree.root, "--max-size", str(2 * real), "--min-age", "0", "--json")
    assert result.exit_code == 0, result.output
    assert all(p.exists() for p in paths) and junk.exists()
    data = json.loads(result.stdout)
    assert data["freed_files"] == 0 and data["target_reached"]


def test_junk_at_a_block_name_is_reported_not_deleted_by_gc(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree", count=1)
    junk = paths[0].parent / f"{'cd' * 20}.kv"
    junk.write_bytes(b"the user's data" * 1000)
    age(junk)
    age(paths[0])
    result = run("gc", tree.root, "--max-size", "0", "--min-age", "0")
    assert junk.exists() and not paths[0].exists()
    assert "1 file" in result.stdout and "not blocks pykv wrote" in result.stdout


# -- leaks --------------------------------------------------------------------------------------

def full_disk(monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", no_space)


def temps_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp." in p.name)


def test_ensure_namespace_on_a_full_disk_leaves_no_temp(tmp_path, monkeypatch):
    tree = KVTree.create(tmp_path / "tree")
    full_disk(monkeypatch)
    with pytest.raises(OSError):
        tree.ensure_namespace(NS)
    assert temps_under(tree.root) == []


def test_gc_on_a_full_disk_leaves_no_gc_json_temp(tmp_path, monkeypatch):
    tree, _ = tree_with_blocks(tmp_path / "tree")
    full_disk(monkeypatch)
    run_gc(tree, 10**12, min_age_s=0)
    assert temps_under(tree.root) == []


def test_fsck_finds_and_cleans_every_temp_pykv_can_leave(tmp_path, monkeypatch):
    from pykv.io import probe
    tree, paths = tree_with_blocks(tmp_path / "tree")
    monkeypatch.setattr(probe, "_filesystem_magic", lambda directory: None)  # not memory-backed: it probes
    monkeypatch.setattr(os, "unlink", lambda *a, **k: None)  # killed before it cleaned up
    probe.direct_io_supported(tree.root)
    monkeypatch.undo()
    planted = [tree.root / ".pykv" / "gc.json.tmp.host.1.abcd", tree.root / NS.id / f"{NAMESPACE_FILE}.tmp.h.2.ab",
               tree.root / f"{MARKER_NAME}.tmp.h.3.ab", paths[0].parent / f"{paths[0].name}.tmp.h.4.ab"]
    (tree.root / ".pykv").mkdir(exist_ok=True)
    for path in planted:
        path.write_bytes(b"partial")
        age(path)
    for path in tree.root.iterdir():
        if path.name.startswith("pykv-direct-probe"):
            age(path)
    left = temps_under(tree.root)
    assert len(left) == 5, left  # the probe's file is one of them, named as a temp
    report = repair(tree, fsck(tree, grace_s=0))
    assert sorted(f.path for f in report.deleted) == left and not report.moved
    assert temps_under(tree.root) == []


# -- terminal output ------------------------------------------------------------------------------

def test_names_and_fields_from_the_tree_print_as_text(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    leaf = paths[0].parent
    (leaf / "[red]evil").write_text("x")
    (leaf / "\x1b[2J\x1b]0;owned\x07bell").write_text("x")
    os.close(os.open(os.path.join(os.fsencode(leaf), b"bad\xffbyte"), os.O_CREAT | os.O_WRONLY, 0o600))
    description = tree.root / NS.id / NAMESPACE_FILE
    data = json.loads(description.read_text())
    description.write_text(json.dumps({**data, "model": "m[/bold]\x1b[31m"}))
    inspected = run("inspect", tree.root)
    assert inspected.exit_code == 0, inspected.output
    assert "m[/bold]\\x1b[31m" in inspected.stdout
    checked = run("fsck", tree.root)
    assert "[red]evil" in checked.stdout and "\\x1b[2J\\x1b]0;owned\\x07bell" in checked.stdout
    assert "bad\\xffbyte" in checked.stdout
    for result in (inspected, checked):
        assert "\x1b" not in result.output and "\x07" not in result.output


def test_long_paths_in_fsck_output_stay_on_one_line(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    name = "n" * 200
    (paths[0].parent / name).write_text("x")
    result = run("fsck", tree.root)
    line = next(line for line in result.stdout.splitlines() if name in line)
    assert os.path.relpath(paths[0].parent / name, tree.root) in line
    assert "checked 2 blocks" in result.stdout


def test_one_block_is_one_block(tmp_path):
    tree, _ = tree_with_blocks(tmp_path / "tree", count=1)
    assert "checked 1 block\n" in run("fsck", tree.root).stdout


def test_the_connector_refuses_at_start_a_root_of_the_users_files(tmp_path):
    pytest.importorskip("vllm")
    from pykv.config import PykvConfig
    from pykv.connector.manager import PykvManager
    from reliability.connector_rig import offloading_config

    user = tmp_path / "home"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    config = offloading_config(str(user))
    with pytest.raises(NotATreeError, match=r"kv_connector_extra_config\.root: .* holds files"):
        PykvManager(config, PykvConfig.from_extra_config(config.extra_config))
    assert sorted(os.listdir(user)) == ["thesis.tex"]
    assert run("init", user).exit_code == 0
    PykvManager(config, PykvConfig.from_extra_config(config.extra_config))  # made a tree on purpose: starts
