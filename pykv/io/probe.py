"""Choose an I/O backend at start and check what the storage directory supports."""

from __future__ import annotations

import ctypes
import errno
import logging
import os

from pykv.errors import PykvError
from pykv.io.backend import IoBackend, IoRequest, OpKind
from pykv.io.memory import ALIGNMENT, aligned_buffer
from pykv.io.threadpool import ThreadPoolBackend
from pykv.io.uring import UringBackend, uring_available
from pykv.treenames import PROBE_NAME, temp_name

logger = logging.getLogger(__name__)

BACKEND_KINDS = ("auto", "io_uring", "threadpool")

# statfs f_type of memory-backed filesystems, where O_DIRECT bypasses nothing:
# kernels before 6.6 refuse it on tmpfs, later ones accept it and ignore alignment.
_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


class BackendUnavailable(PykvError):
    """The requested I/O backend cannot run here; the message says why."""


def open_backend(kind: str = "auto", depth: int = 64, *, directory: str | None = None) -> IoBackend:
    """Open an I/O backend of ``kind`` ("auto", "io_uring" or "threadpool").

    "auto" uses io_uring when it works and otherwise falls back to the thread
    pool with one warning naming the reason.  With ``directory``, io_uring must
    also open and close that directory asynchronously (catches seccomp or LSM
    rules that allow the ring but not its operations).  Asking for "io_uring"
    where it does not work raises ``BackendUnavailable``.
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown I/O backend {kind!r}; choose one of {', '.join(BACKEND_KINDS)}")
    if kind == "threadpool":
        return ThreadPoolBackend(depth)
    ok, reason = uring_available()
    if ok:
        backend = UringBackend(depth)
        try:
            ok, reason = _check_directory(backend, directory) if directory else (True, "")
        except BaseException:
            backend.close()
            raise
        if ok:
            return backend
        backend.close()
    if kind == "io_uring":
        raise BackendUnavailable(reason)
    logger.warning("io_uring unavailable, using the threadpool I/O backend: %s", reason)
    return ThreadPoolBackend(depth)


def _check_directory(backend: IoBackend, directory: str) -> tuple[bool, str]:
    """Open and close ``directory`` through ``backend``; raise OSError if the
    directory itself cannot be opened (that is no reason to change backend)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    backend.submit([IoRequest(OpKind.OPEN, "probe-open", path=os.fsencode(directory), flags=flags)])
    (opened,) = backend.wait(1)
    if opened.result < 0:
        os.close(os.open(directory, flags))  # raises when the directory is the problem
        return False, f"io_uring could not open {directory}: {os.strerror(-opened.result)}"
    backend.submit([IoRequest(OpKind.CLOSE, "probe-close", fd=opened.result)])
    backend.wait(1)
    return True, ""


def _filesystem_magic(directory: str | os.PathLike[str]) -> int | None:
    """statfs(2) ``f_type`` of ``directory`` (None if unknown)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    try:
        statfs = ctypes.CDLL(None, use_errno=True).statfs
    except AttributeError:
        return None
    if statfs(os.fsencode(directory), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def direct_io_supported(directory: str | os.PathLike[str]) -> tuple[bool, str]:
    """Whether files in ``directory`` take O_DIRECT I/O: create a temporary file and
    write then read back one aligned block.  Memory-backed filesystems (tmpfs,
    ramfs) count as unsupported.  Returns ``(ok, reason)``."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this platform has no O_DIRECT"
    memory_fs = _MEMORY_FILESYSTEMS.get(_filesystem_magic(directory))
    if memory_fs:
        return False, f"{directory}: {memory_fs} is memory-backed, O_DIRECT would bypass no cache"
    path = os.path.join(os.fspath(directory), temp_name(PROBE_NAME))  # a pykv temp: fsck cleans what a kill left
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        try:
            os.unlink(path)  # some filesystems create the file, then refuse O_DIRECT
        except OSError:
            pass
        if exc.errno == errno.EINVAL:
            return False, f"{directory}: filesystem refuses O_DIRECT (tmpfs?)"
        return False, f"{directory}: cannot create O_DIRECT probe file: {exc.strerror}"
    try:
        out, back = aligned_buffer(ALIGNMENT), aligned_buffer(ALIGNMENT)
        pattern = os.urandom(ALIGNMENT)
        out[:] = pattern
        try:
            written = os.pwritev(fd, [out], 0)
            read = os.preadv(fd, [back], 0)
        except OSError as exc:
            return False, f"{directory}: O_DIRECT transfer failed: {exc.strerror}"
        if written != ALIGNMENT or read != ALIGNMENT or back[:] != pattern:
            return False, f"{directory}: O_DIRECT round trip returned wrong data"
        return True, f"{directory}: O_DIRECT works"
    finally:
        os.close(fd)
        os.unlink(path)
