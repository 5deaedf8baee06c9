"""The POSIX medium over a real tree: opens beneath the root without links, refuses what is not
a regular file, publishes without replacing, quarantines without deleting; and the registry."""

from __future__ import annotations

import errno
import os

import pytest

from pykv.io.openat2 import RESOLVE_NO_SYMLINKS, openat2
from pykv.media import MEDIA, Medium, PosixMedium, StripedMedium, open_medium
from pykv.namespace import Namespace
from pykv.tree import KVTree, is_temp_name

NS = Namespace("tiny", "bf16", "test", 64)
KEY = bytes(range(20))


@pytest.fixture
def medium(tmp_path) -> PosixMedium:
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    return PosixMedium(tree, direct=False)


def open_read(medium: PosixMedium, location) -> int:
    spec = medium.open_for_read(location)
    return openat2(spec.path, spec.flags, spec.mode, spec.resolve)


def test_the_registry_opens_a_medium_by_name(tmp_path):
    tree = KVTree.create(tmp_path / "tree")
    assert MEDIA == {"posix": PosixMedium, "striped": StripedMedium}
    assert isinstance(open_medium("posix", tree, direct=False), PosixMedium)
    with pytest.raises(ValueError, match="unknown medium 'tape'; one of: posix, striped"):
        open_medium("tape", tree)


def test_posix_medium_fulfils_the_contract():
    assert issubclass(PosixMedium, Medium) and not PosixMedium.__abstractmethods__


def test_a_block_opens_beneath_the_real_root_without_links_and_reports_its_size(medium):
    location = medium.locate(NS.id, KEY)
    assert location == medium.tree.block_path(NS.id, KEY)
    spec = medium.open_for_read(location)
    assert spec.resolve == RESOLVE_NO_SYMLINKS
    assert spec.flags & os.O_NOFOLLOW and spec.flags & os.O_NONBLOCK and not spec.flags & os.O_DIRECT
    assert os.O_DIRECT & PosixMedium(medium.tree).open_for_read(location).flags
    location.parent.mkdir(parents=True)
    location.write_bytes(b"x" * 5000)
    fd = open_read(medium, location)
    try:
        assert medium.check_opened(fd) == 5000
    finally:
        os.close(fd)


@pytest.mark.parametrize("planted", ["fifo", "directory"])
def test_anything_but_a_regular_file_is_refused_after_the_open(medium, planted):
    location = medium.locate(NS.id, KEY)
    location.parent.mkdir(parents=True)
    os.mkfifo(location) if planted == "fifo" else location.mkdir()
    fd = open_read(medium, location)  # O_NONBLOCK: a FIFO with no writer does not block the open
    try:
        with pytest.raises(OSError) as refused:
            medium.check_opened(fd)
        assert refused.value.errno == (errno.EINVAL if planted == "fifo" else errno.EISDIR)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["block", "shard directory"])
def test_a_symlink_anywhere_below_the_root_fails_the_open(medium, tmp_path, where):
    location = medium.locate(NS.id, KEY)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / location.name).write_bytes(b"not ours")
    if where == "block":
        location.parent.mkdir(parents=True)
        location.symlink_to(outside / location.name)
    else:
        location.parent.parent.mkdir(parents=True)
        location.parent.symlink_to(outside)
    with pytest.raises(OSError) as refused:
        open_read(medium, location)
    assert refused.value.errno == errno.ELOOP


def test_a_write_is_prepared_beside_the_block_and_published_without_replacing(medium):
    location = medium.locate(NS.id, KEY)
    target = medium.prepare_write(location)
    assert target.temp.parent == location.parent and is_temp_name(target.temp.name)
    assert target.open.resolve == RESOLVE_NO_SYMLINKS and target.open.flags & os.O_EXCL
    fd = openat2(target.open.path, target.open.flags, target.open.mode, target.open.resolve)
    os.write(fd, b"first")
    os.close(fd)
    assert medium.publish(target.temp, location) and location.read_bytes() == b"first"

    second = medium.prepare_write(location)
    second.temp.write_bytes(b"second")
    assert medium.publish(second.temp, location) is False  # another writer won: its block stays
    assert location.read_bytes() == b"first" and not second.temp.exists()


def test_an_abandoned_write_leaves_nothing(medium):
    location = medium.locate(NS.id, KEY)
    target = medium.prepare_write(location)
    target.temp.write_bytes(b"half")
    medium.abandon(target.temp)
    medium.abandon(target.temp)  # gone already: never raises
    assert list(location.parent.iterdir()) == []


def test_lookup_sees_published_blocks_only_and_touch_stamps_them(medium, tmp_path):
    location = medium.locate(NS.id, KEY)
    assert not medium.contains(NS.id, KEY) and medium.touch(location) is False
    location.parent.mkdir(parents=True)
    location.symlink_to(tmp_path / "elsewhere")
    assert not medium.contains(NS.id, KEY)  # a link is no block
    location.unlink()
    location.write_bytes(b"block")
    os.utime(location, (1, 1))
    assert medium.contains(NS.id, KEY) and medium.touch(location)
    assert location.stat().st_atime > 1 and location.stat().st_mtime == 1


def test_quarantine_moves_the_block_and_never_deletes(medium):
    location = medium.locate(NS.id, KEY)
    location.parent.mkdir(parents=True)
    location.write_bytes(b"corrupt")
    moved = medium.quarantine(location, "run-1")
    assert not location.exists() and moved.read_bytes() == b"corrupt"
    assert moved.is_relative_to(medium.tree.state_dir / "quarantine" / "run-1")
    with pytest.raises(FileNotFoundError):
        medium.quarantine(location, "run-1")
