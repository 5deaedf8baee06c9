"""The adversarial matrix: something planted at every place of a tree, as every kind of file,
under every kind of name; then ``inspect``, ``gc``, ``fsck`` and ``fsck --repair`` run on it.

Whatever is planted, each command ends within its deadline (nothing blocks on a FIFO
or reads ``/dev/zero``), exits with a status and at most one error line (no
traceback), writes no raw control character to the terminal, changes nothing outside
the root, and leaves everything planted somewhere under the root (in place or in
``.pykv/quarantine``): pykv never deletes what it did not create. (A regular file with
one link under a name only pykv writes — a temp's name, ``.pykv/gc.json`` — is pykv's:
a stale temp is deleted, gc.json replaced.) The engine's load path is run against
every kind at a block's name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pykv.blockfile import write_block
from pykv.commands.app import app
from pykv.format import Geometry
from pykv.tree import KVTree

from reliability.deadline import deadline
from reliability.rig import NS, Rig, key_of, payload_of

GEOMETRY = Geometry(tokens=256, segments=1, segment_bytes=8192)
OLD_NS = 1_000_000_000 * 10**9

PLACES = {"root": "", "namespace": NS.id, "upper-shard": f"{NS.id}/00", "leaf": "{leaf}", "state": ".pykv"}
NAMES = {
    "block": "{block}",  # a block's name (in the leaf: the name of a key pykv would look up)
    "temp": "{block}.tmp.host.1.abcd",
    "metadata": "{metadata}",  # the marker at the root, namespace.json, gc.json in .pykv
    "directory's": "{directory}",  # where a directory belongs: .pykv at the root, a shard, the quarantine
    "longest": "l" * 255,
    "markup-and-bytes": b"[red]e\x1b[31mv\xffil\n".decode("utf-8", "surrogateescape"),
}
KINDS = ["file", "directory", "symlink-to-file", "symlink-to-dir", "symlink-to-dev-zero", "fifo", "socket", "device",
         "hardlink"]
DIRECTORY = {"root": ".pykv", "namespace": "ff", "upper-shard": "ff", "leaf": "ff", "state": "quarantine"}
METADATA = {"root": "pykv-tree.json", "namespace": "namespace.json", "upper-shard": "namespace.json",
            "leaf": "namespace.json", "state": "gc.json"}
COMMANDS = [["inspect"], ["gc", "--max-size", "0", "--min-age", "0"], ["fsck", "--grace", "0"],
            ["fsck", "--repair", "--grace", "0"], ["inspect", "--no-catalog"]]




def plant(path: Path, kind: str, outside: Path) -> list[int]:
    """Make ``path`` a ``kind``; return the inodes that must survive (under the root)."""
    if kind == "file":
        path.write_bytes(b"someone's data\n" * 100)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_text("someone's data")
        return [os.lstat(path).st_ino, os.lstat(path / "inside").st_ino]
    elif kind == "symlink-to-file":
        path.symlink_to(outside / "precious")
    elif kind == "symlink-to-dir":
        path.symlink_to(outside)
    elif kind == "symlink-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        with contextlib.chdir(path.parent):
            server = socket.socket(socket.AF_UNIX)
            server.bind(path.name)
            server.close()
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    elif kind == "hardlink":
        os.link(outside / "precious", path)
    os.utime(path, ns=(OLD_NS, OLD_NS), follow_symlinks=False)
    return [os.lstat(path).st_ino]


def inodes_under(root: Path) -> set[int]:
    found = set()
    for directory, dirs, names in os.walk(root):  # never follows links
        for name in dirs + names:
            found.add(os.lstat(os.path.join(directory, name)).st_ino)
    return found


def snapshot(directory: Path) -> dict[str, tuple]:
    out = {}
    for path in sorted(directory.rglob("*")):
        st = os.lstat(path)
        out[str(path.relative_to(directory))] = (st.st_mode, st.st_size, st.st_mtime_ns,
                                                 path.read_bytes() if path.is_file() else b"")
    return out


def build(tmp_path: Path, place: str, name: str, kind: str) -> tuple[KVTree, Path, Path]:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    for i in range(3):
        write_block(tree, NS.id, key_of(i), GEOMETRY, payload_of(key_of(i), GEOMETRY.payload_length))
        os.utime(tree.block_path(NS.id, key_of(i)), ns=(OLD_NS, OLD_NS))
    victim_key = key_of(7)
    leaf = tree.block_path(NS.id, victim_key).parent
    leaf.mkdir(parents=True, exist_ok=True)
    where = tree.root / PLACES[place].format(leaf=os.path.relpath(leaf, tree.root))
    where.mkdir(parents=True, exist_ok=True)
    text = name.format(block=tree.block_path(NS.id, victim_key).name, metadata=METADATA[place],
                       directory=DIRECTORY[place])
    target = where / text
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)  # a directory pykv made (.pykv): the planted thing replaces it
    elif target.exists() or target.is_symlink():  # a metadata file pykv made: the planted thing replaces it
        os.unlink(target)
    return tree, target, outside


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(NAMES))
@pytest.mark.parametrize("place", list(PLACES))
def test_the_commands_survive_anything_anywhere(tmp_path, place, name, kind):
    tree, target, outside = build(tmp_path, place, NAMES[name], kind)
    if kind == "socket" and len(os.fsencode(target.name)) > 100:
        pytest.skip("a socket's name is limited to 107 bytes")
    survivors = plant(target, kind, outside)
    before = snapshot(outside)
    for command in COMMANDS:
        argv = [command[0], str(tree.root), *command[1:]]
        with deadline(30):
            result = CliRunner().invoke(app, argv)
        where = f"{argv}: {result.output}"
        assert result.exit_code in (0, 1, 2), where
        assert "Traceback" not in result.output and not isinstance(result.exception, TimeoutError), where
        if result.exception is not None:
            assert isinstance(result.exception, SystemExit), (where, repr(result.exception))
        assert result.stderr.count("\n") <= 1, where
        assert not any(ch in result.output for ch in "\x1b\x07\x00"), where
    assert snapshot(outside) == before  # nothing outside written, moved or deleted
    if kind == "file" and (name == "temp" or (place == "state" and name == "metadata")):
        return  # a regular file under a name only pykv writes (a temp's, gc.json): pykv's own
    assert set(survivors) <= inodes_under(tree.root)  # nothing pykv did not create was deleted


@pytest.mark.parametrize("backend", ["threadpool", "io_uring"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_load_of_anything_at_a_block_name_misses_without_hanging_or_harm(tmp_path, backend, kind):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    with Rig(tmp_path / "tree", backend=backend) as rig:
        if rig.reactor.backend.name != backend:
            pytest.skip(f"{backend} unavailable here")
        key = key_of(3)
        path = rig.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        plant(path, kind, outside)
        with deadline(30):
            outcome = rig.load([key], timeout=20)
        assert outcome.result is not None and 0 in outcome.result.failed, outcome
        before = snapshot(outside)
        moved = rig.tree.quarantine(path, "load-host-1")  # the worker's quarantine of a failed load
        assert os.path.lexists(moved) and not os.path.lexists(path)  # the entry itself, nothing followed
        assert snapshot(outside) == before
