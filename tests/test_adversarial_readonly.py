"""Adversarial tests for a tree on a read-only mount (docs/adversarial-matrix.md).

security.md: an engine with ``store=false`` "still moves a block that fails its checks into
``.pykv/quarantine/`` where it may; on a read-only mount … that move fails, the load is a miss
all the same, and ``pykv fsck`` reports the file"; deployment.md: "A read-only mount serves
engines with ``store=false`` only". Here a damaged tree (a corrupt block, junk at a block's
name, a FIFO at one, a stale temp, a hostile lease) is bind-mounted read-only and every
command and the engine's load path run on it: no traceback, no hang, nothing changed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from mounts import bind  # noqa: F401  (fixture)
from typer.testing import CliRunner

from pykv.blockfile import write_block
from pykv.commands.app import app
from pykv.format import HEADER_SIZE, Geometry
from pykv.tree import LEASE_NAME, KVTree

from reliability.deadline import deadline
from reliability.rig import NS, Rig, key_of, payload_of

GEOMETRY = Geometry(tokens=256, segments=1, segment_bytes=8192)
OLD_NS = 1_000_000_000 * 10**9  # 2001
COMMANDS = [["inspect"], ["inspect", "--json"], ["gc", "--max-size", "0", "--min-age", "0"], ["fsck", "--grace", "0"],
            ["fsck", "--repair", "--grace", "0"], ["doctor"]]


def read_quietly(path: Path) -> bytes:
    """The file's bytes, read without moving its atime (the snapshot must not change what it compares)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOATIME | os.O_NOFOLLOW)
    try:
        return os.read(fd, os.fstat(fd).st_size + 1)
    finally:
        os.close(fd)


def snapshot(directory: Path) -> dict[str, tuple]:
    out = {}
    for path in sorted(directory.rglob("*")):
        st = os.lstat(path)
        data = read_quietly(path) if path.is_file() and not path.is_symlink() else b""
        out[str(path.relative_to(directory))] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_atime_ns, data)
    return out


@pytest.fixture
def damaged_read_only(tmp_path, bind):
    disk = tmp_path / "disk"
    tree = KVTree.create(disk)
    tree.ensure_namespace(NS)
    for i in range(4):
        write_block(tree, NS.id, key_of(i), GEOMETRY, payload_of(key_of(i), GEOMETRY.payload_length))
    corrupt = tree.block_path(NS.id, key_of(0))
    data = bytearray(corrupt.read_bytes())
    data[HEADER_SIZE + 10] ^= 1
    corrupt.write_bytes(bytes(data))
    tree.block_path(NS.id, key_of(1)).write_bytes(b"junk at a block's name")
    fifo = tree.block_path(NS.id, key_of(2))
    os.unlink(fifo)
    os.mkfifo(fifo)
    (corrupt.parent / (corrupt.name + ".tmp.host.1.abcd")).write_bytes(b"stale")
    tree.ensure_state_dir()
    (tree.state_dir / LEASE_NAME).write_text("[" * 4000)
    for path in disk.rglob("*"):
        os.utime(path, ns=(OLD_NS, OLD_NS), follow_symlinks=False)
    read_only = bind(disk, tmp_path / "ro", read_only=True)
    return disk, read_only


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_on_a_damaged_read_only_tree_changes_nothing_and_never_crashes(damaged_read_only, command):
    disk, read_only = damaged_read_only
    before = snapshot(disk)
    with deadline(60):
        result = CliRunner().invoke(app, [command[0], str(read_only), *command[1:]])
    assert result.exit_code in (0, 1, 2), result.output
    assert "Traceback" not in result.output and result.stderr.count("pykv: error:") <= 1, result.output
    assert snapshot(disk) == before
    if command[0] == "fsck":
        assert result.exit_code == 1  # the damage is reported (and, with --repair, not repaired)


@pytest.mark.parametrize("backend", ["threadpool", "io_uring"])
def test_a_load_from_a_read_only_tree_misses_what_fails_and_its_quarantine_fails_harmlessly(damaged_read_only,
                                                                                             backend):
    disk, read_only = damaged_read_only
    before = snapshot(disk)
    with Rig(read_only, backend=backend, create=False) as rig:
        if rig.reactor.backend.name != backend:
            pytest.skip(f"{backend} unavailable here")
        keys = [key_of(i) for i in range(4)]
        with deadline(30):
            outcome = rig.load(keys, timeout=20)
        assert outcome.result is not None
        assert 0 in outcome.result.failed and 3 in outcome.delivered and not outcome.mismatched
        for key in keys[:3]:
            with pytest.raises(OSError) as raised:  # the worker's quarantine of a failed load calls this
                rig.tree.quarantine(rig.path(key), "load-host-1")
            assert raised.value.errno == errno.EROFS
    assert snapshot(disk) == before
