"""Opening a path without following any symlink in it: openat2(2) with RESOLVE_NO_SYMLINKS.

``O_NOFOLLOW`` refuses a symlink only as the last component; a symlink planted
as a namespace or shard directory would still be followed. The serving path
therefore opens block files with ``RESOLVE_NO_SYMLINKS`` (Linux >= 5.6): any
symlink anywhere in the path fails the open with ``ELOOP``. The io_uring backend
passes ``open_how`` to IORING_OP_OPENAT2; the thread-pool backend calls
``openat2`` here, which on kernels without the syscall walks the path one
component at a time with ``O_NOFOLLOW`` (same result, a few more syscalls).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct

RESOLVE_NO_SYMLINKS = 0x04  # <linux/openat2.h>
RESOLVE_BENEATH = 0x08  # no ".." above, no absolute path: the result stays below ``dir_fd``
OPEN_HOW = struct.Struct("<QQQ")  # struct open_how: flags, mode, resolve
_SYS_OPENAT2 = 437  # the same on x86-64 and aarch64
_AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_have_openat2 = True


def open_how(flags: int, mode: int, resolve: int) -> bytes:
    """The bytes of ``struct open_how`` (openat2 refuses a mode without O_CREAT: pass 0 then)."""
    return OPEN_HOW.pack(flags, mode if flags & os.O_CREAT else 0, resolve)


def openat2(path: bytes | str, flags: int, mode: int = 0, resolve: int = RESOLVE_NO_SYMLINKS,
            *, dir_fd: int | None = None) -> int:
    """Open ``path`` (relative to ``dir_fd`` when given) like ``os.open`` under openat2's
    ``resolve`` rules; raise ``OSError``."""
    global _have_openat2
    path = os.fsencode(path)
    if resolve & ~(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH):
        raise ValueError(f"unsupported resolve flags {resolve:#x}")
    if _have_openat2:
        how = ctypes.create_string_buffer(open_how(flags | os.O_CLOEXEC, mode, resolve), OPEN_HOW.size)
        fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(_AT_FDCWD if dir_fd is None else dir_fd),
                      ctypes.c_char_p(path), how, ctypes.c_size_t(OPEN_HOW.size))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.ENOSYS:
            raise OSError(err, os.strerror(err), os.fsdecode(path))
        _have_openat2 = False
    if not resolve:
        return os.open(path, flags, mode, dir_fd=dir_fd)
    return _open_walking(path, flags, mode, resolve, dir_fd)


def _open_walking(path: bytes, flags: int, mode: int, resolve: int, dir_fd: int | None) -> int:
    """RESOLVE_NO_SYMLINKS (and BENEATH) by hand: every directory entered with O_NOFOLLOW, then
    the last name; under BENEATH an absolute path or a ".." component is refused (EXDEV)."""
    parts = [part for part in path.split(b"/") if part and part != b"."]
    if not parts:
        raise OSError(errno.EINVAL, "empty path", os.fsdecode(path))
    if resolve & RESOLVE_BENEATH and (path.startswith(b"/") or b".." in parts):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fsdecode(path))
    start = b"/" if path.startswith(b"/") else b"."
    directory = os.open(start, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    for part in parts[:-1]:
        directory = enter_directory(directory, part)
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory)
    finally:
        os.close(directory)


def enter_directory(directory: int, name: bytes | str) -> int:
    """An O_PATH fd of directory ``name`` under fd ``directory``, which is closed (also on failure).

    A symlink is not followed: ``ELOOP``; anything else but a directory: ``ENOTDIR``.
    """
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    finally:
        os.close(directory)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISDIR(mode):
        os.close(fd)
        err = errno.ELOOP if stat.S_ISLNK(mode) else errno.ENOTDIR
        raise OSError(err, os.strerror(err), os.fsdecode(name))
    return fd
