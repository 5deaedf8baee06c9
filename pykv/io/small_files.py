"""Small state files written whole: the lease, ``evict.json``, ``gc.json``, ``set.json``, ``namespace.json``.

A file's bytes are written and synced before its name appears. On a local file system known to
keep a linked ``O_TMPFILE`` file (ext2/3/4, XFS, btrfs, tmpfs, f2fs) they go into an unnamed file
in the target directory, linked to its name once synced, so a process killed meanwhile leaves
nothing; vLLM's multiprocess engine core is often killed at shutdown before it calls the
connector's hook, mid eviction round (docs/reliability.md, "An engine killed mid-round").
Elsewhere (FUSE, NFS, overlayfs; JuiceFS takes ``O_TMPFILE`` and the link, then drops the file
when its fd closes), or without ``/proc``, the file is written under a name, and a temp that a
kill leaves is ``pykv fsck``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
from pathlib import Path

from pykv.treenames import temp_name

_NAMED_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_UNNAMED_FLAGS = getattr(os, "O_TMPFILE", 0) | os.O_WRONLY | os.O_CLOEXEC
_NO_UNNAMED = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOSYS})
"""How a file system without ``O_TMPFILE`` (or a kernel before 3.11) refuses it."""
_PROC_FD = "/proc/self/fd"
_PROC_FD_USABLE = hasattr(os, "O_TMPFILE") and os.path.isdir(_PROC_FD)
"""Whether an unnamed file can be linked in: ``O_TMPFILE`` exists and ``/proc`` is mounted."""
UNNAMED_FILE_SYSTEMS = frozenset({0xEF53, 0x58465342, 0x9123683E, 0x01021994, 0xF2F52010})
"""``statfs`` magic numbers of ext2/3/4, XFS, btrfs, tmpfs and f2fs: where unnamed files are used."""
_STATFS_BYTES = 512  # more than ``struct statfs`` takes on any Linux ABI


def write_small(path: Path | str, content: bytes, mode: int, *, dir_fd: int | None = None) -> None:
    """Create ``path`` (``FileExistsError`` where any file or link stands) holding ``content``,
    synced; the name appears only once whole where the file system allows it (see above). On any
    failure (a full disk) nothing is left under ``path``."""
    if dir_fd is None or not _link_unnamed(path, content, mode, dir_fd):
        _write_named(path, content, mode, dir_fd)


def publish_small(name: str, content: bytes, mode: int, *, dir_fd: int) -> bool:
    """Create ``name`` in the directory ``dir_fd`` holding ``content``, synced, seen by others only
    whole; False where a file or link stands at ``name`` already (left as it is)."""
    try:
        if _link_unnamed(name, content, mode, dir_fd):
            return True
    except FileExistsError:
        return False
    temp = temp_name(name)
    _write_named(temp, content, mode, dir_fd)
    try:
        os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
    return True


def replace_small(name: str, content: bytes, mode: int, *, dir_fd: int) -> None:
    """Replace ``name`` in the directory ``dir_fd`` atomically with ``content`` (a synced temp beside
    it, renamed over it); the temp is removed again when either step fails (a full disk)."""
    temp = temp_name(name)
    write_small(temp, content, mode, dir_fd=dir_fd)
    try:
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise


def _link_unnamed(path: Path | str, content: bytes, mode: int, dir_fd: int) -> bool:
    """Write ``content`` into an unnamed file beside ``path``, sync it and link it to ``path``
    (``FileExistsError`` where a name stands); False, having done nothing, without ``O_TMPFILE``."""
    if not _PROC_FD_USABLE or file_system_magic(dir_fd) not in UNNAMED_FILE_SYSTEMS:
        return False
    try:
        fd = os.open(os.path.dirname(os.fspath(path)) or ".", _UNNAMED_FLAGS, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _NO_UNNAMED:
            return False
        raise
    try:  # an unnamed file vanishes with its last fd, whatever fails
        _write_all(fd, content)
        os.fsync(fd)
        try:
            os.link(f"{_PROC_FD}/{fd}", path, dst_dir_fd=dir_fd)  # linkat(AT_SYMLINK_FOLLOW): never over a name
        except FileExistsError:
            raise
        except OSError:  # /proc refused the link (a security module, a restricted /proc): a named file instead
            return False
    finally:
        os.close(fd)
    return True


def _write_named(path: Path | str, content: bytes, mode: int, dir_fd: int | None) -> None:
    fd = os.open(path, _NAMED_FLAGS, mode, dir_fd=dir_fd)
    try:
        _write_all(fd, content)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path, dir_fd=dir_fd)
        raise
    os.close(fd)


def _write_all(fd: int, content: bytes) -> None:
    remaining = memoryview(content)
    while remaining:
        remaining = remaining[os.write(fd, remaining):]


def file_system_magic(fd: int) -> int | None:
    """The ``f_type`` ``fstatfs`` gives for ``fd`` (an ``O_PATH`` fd will do), None where it fails."""
    libc = _libc()
    if libc is None:
        return None
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if libc.fstatfs(fd, buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF  # f_type comes first, a long


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fstatfs.argtypes = (ctypes.c_int, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    return libc
