"""io_uring backend: our own small ctypes binding over the raw io_uring syscalls.

Why our own binding rather than a package (checked 2026-11, see IO_NOTES.md):

- the ``liburing`` 2026 wheels die with SIGILL on AVX2-only CPUs (our EPYC dev/CI);
- ``liburing`` 2024 holds the GIL while waiting, which would stall a vLLM worker;
- ``pyuring`` only has synchronous openat/close/fsync and binds a ring to the
  thread that created it;
- ctypes releases the GIL during each syscall, and we need asynchronous
  OPENAT/READ/WRITE/FSYNC/CLOSE.  Only the stdlib (ctypes, mmap, os, struct) is used.

Mechanics: one ring without SQPOLL; the SQ index array is the identity, so an SQE
is written at ``tail & mask`` and published by storing the new tail, after which
``submit`` calls io_uring_enter at once.  ``wait`` reaps the CQ ring and blocks in
io_uring_enter(GETEVENTS | EXT_ARG) with a kernel timespec.  ``wake`` writes to an
eventfd on which a READ is always posted in the ring (re-armed on completion; it
does not count toward ``depth``).  Stores and loads of ring indices are single
aligned 32-bit accesses made from Python, in program order; x86-64 is TSO, and the
kernel reads the SQ tail only inside our own io_uring_enter call.

Needs Linux >= 5.11 (IORING_FEAT_EXT_ARG).  Syscall numbers 425/426 are the same
on x86-64 and aarch64.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import struct
import sys
import threading
import time
from typing import Sequence

from pykv.io.backend import IoBackend, IoCompletion, IoRequest, OpKind
from pykv.io.memory import buffer_address
from pykv.io.openat2 import OPEN_HOW, open_how

_SYS_IO_URING_SETUP = 425
_SYS_IO_URING_ENTER = 426

# enum io_uring_op in <linux/io_uring.h>
_OP_FSYNC = 3
_OP_OPENAT = 18
_OP_OPENAT2 = 28
_OP_CLOSE = 19
_OP_READ = 22
_OP_WRITE = 23
_IOSQE_ASYNC = 1 << 4  # sqe flag: issue from an io-wq worker, never inline

_ENTER_GETEVENTS = 1 << 0
_ENTER_EXT_ARG = 1 << 3
_FEAT_SINGLE_MMAP = 1 << 0
_FEAT_NODROP = 1 << 1
_FEAT_EXT_ARG = 1 << 8
_OFF_SQ_RING = 0
_OFF_CQ_RING = 0x8000000
_OFF_SQES = 0x10000000
_AT_FDCWD = -100

# opcode, flags, ioprio, fd, off, addr, len, op_flags, user_data, buf_index,
# personality, splice_fd_in, addr3, pad  (struct io_uring_sqe, 64 bytes)
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
_CQE = struct.Struct("<QiI")  # user_data, res, flags (struct io_uring_cqe, 16 bytes)
_U32 = 0xFFFFFFFF
_WAKE_ID = 0  # user_data of the eventfd read; request ids start at 1
_RETRY = (-errno.EINTR, -errno.EAGAIN)


def _u32s(names: str) -> list[tuple[str, type]]:
    return [(name, ctypes.c_uint32) for name in names.split()]


class _SqOffsets(ctypes.Structure):  # struct io_sqring_offsets
    _fields_ = _u32s("head tail ring_mask ring_entries flags dropped array resv1") + [
        ("resv2", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):  # struct io_cqring_offsets
    _fields_ = _u32s("head tail ring_mask ring_entries overflow cqes flags resv1") + [
        ("resv2", ctypes.c_uint64)]


class _Params(ctypes.Structure):  # struct io_uring_params
    _fields_ = _u32s("sq_entries cq_entries flags sq_thread_cpu sq_thread_idle features wq_fd") + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_int64)]


class _GeteventsArg(ctypes.Structure):
    _fields_ = [("sigmask", ctypes.c_uint64), ("sigmask_sz", ctypes.c_uint32),
                ("pad", ctypes.c_uint32), ("ts", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long] * 7


def _sys(number: int, *args: int) -> int:
    """Call a raw syscall (GIL released by ctypes); raise OSError on failure."""
    ret = _syscall(number, *args, *(0,) * (6 - len(args)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _map(fd: int, size: int, offset: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)


class UringBackend(IoBackend):
    """Asynchronous file I/O through one io_uring owned by the calling (reactor) thread."""

    name = "io_uring"

    def __init__(self, depth: int = 64) -> None:
        super().__init__(depth)
        self._ops: dict[int, tuple[IoRequest, tuple, object]] = {}
        self._ids = itertools.count(_WAKE_ID + 1)
        self._maps: list[mmap.mmap] = []
        self._wake_lock = threading.Lock()
        self._event_fd = -1
        params = _Params()
        # Power of two >= depth + 1: room for ``depth`` operations plus the wake read.
        self._fd = _sys(_SYS_IO_URING_SETUP, 1 << depth.bit_length(), ctypes.addressof(params))
        try:
            self._setup_rings(params)
            self._event_fd = os.eventfd(0, os.EFD_CLOEXEC)
            self._wake_buffer = ctypes.c_uint64()
            self._arm_wake()
            self._flush()
        except BaseException:
            self._release()
            raise

    def _setup_rings(self, params: _Params) -> None:
        missing = [name for bit, name in ((_FEAT_EXT_ARG, "EXT_ARG"), (_FEAT_NODROP, "NODROP"))
                   if not params.features & bit]
        if missing:
            raise OSError(errno.ENOTSUP, f"io_uring lacks IORING_FEAT_{'/'.join(missing)} "
                          "(needs Linux >= 5.11)")
        sq, cq = params.sq_off, params.cq_off
        sq_size = sq.array + params.sq_entries * 4
        cq_size = cq.cqes + params.cq_entries * _CQE.size
        single = bool(params.features & _FEAT_SINGLE_MMAP)
        if single:
            sq_size = max(sq_size, cq_size)
        self._sq_map = self._cq_map = _map(self._fd, sq_size, _OFF_SQ_RING)
        self._maps.append(self._sq_map)
        if not single:
            self._cq_map = _map(self._fd, cq_size, _OFF_CQ_RING)
            self._maps.append(self._cq_map)
        self._sqes = _map(self._fd, params.sq_entries * _SQE.size, _OFF_SQES)
        self._maps.append(self._sqes)
        sq_base, cq_base = buffer_address(self._sq_map), buffer_address(self._cq_map)
        u32 = ctypes.c_uint32.from_address
        self._sq_head, self._sq_tail = u32(sq_base + sq.head), u32(sq_base + sq.tail)
        self._sq_mask = u32(sq_base + sq.ring_mask).value
        self._sq_entries = params.sq_entries
        self._sq_local_tail = self._sq_tail.value
        array = (ctypes.c_uint32 * params.sq_entries).from_address(sq_base + sq.array)
        for i in range(params.sq_entries):
            array[i] = i  # identity: SQE slot == ring position
        self._cq_head, self._cq_tail = u32(cq_base + cq.head), u32(cq_base + cq.tail)
        self._cq_mask = u32(cq_base + cq.ring_mask).value
        self._cqes_offset = cq.cqes
        self._ts = _Timespec()
        self._arg = _GeteventsArg()

    # -- IoBackend ---------------------------------------------------------------------

    def submit(self, requests: Sequence[IoRequest]) -> None:
        self._admit(requests)
        prepared = [_prepare(request) for request in requests]  # validate before queuing
        for request, (sqe, keep) in zip(requests, prepared):
            user_data = next(self._ids)
            sqe = _sqe(*sqe, user_data)
            self._ops[user_data] = (request, sqe, keep)
            self._push(sqe)
        self._in_flight += len(requests)
        self._flush()

    def wait(self, min_completions: int = 1, timeout: float | None = None) -> list[IoCompletion]:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        done: list[IoCompletion] = []
        while True:
            woken = self._reap(done)
            if woken or len(done) >= min_completions:
                return done
            if deadline is None:
                self._arg.ts = 0
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return done
                self._ts.tv_sec, self._ts.tv_nsec = divmod(int(remaining * 1e9), 1_000_000_000)
                self._arg.ts = ctypes.addressof(self._ts)
            # Never wait for more than can arrive; with nothing in flight only
            # a wake or the timeout ends the wait.
            want = max(1, min(min_completions - len(done), self._in_flight))
            try:
                _sys(_SYS_IO_URING_ENTER, self._fd, 0, want, _ENTER_GETEVENTS | _ENTER_EXT_ARG,
                     ctypes.addressof(self._arg), ctypes.sizeof(self._arg))
            except OSError as exc:
                if exc.errno not in (errno.EINTR, errno.ETIME):
                    raise

    def wake(self) -> None:
        with self._wake_lock:
            if self._event_fd >= 0:
                os.eventfd_write(self._event_fd, 1)

    # -- ring mechanics ----------------------------------------------------------------

    def _push(self, sqe: tuple) -> None:
        tail = self._sq_local_tail
        if (tail - self._sq_head.value) & _U32 >= self._sq_entries:
            raise RuntimeError("io_uring submission queue is full")  # depth accounting bug
        _SQE.pack_into(self._sqes, (tail & self._sq_mask) * _SQE.size, *sqe)
        self._sq_local_tail = (tail + 1) & _U32

    def _flush(self) -> None:
        """Publish pushed SQEs and have the kernel consume all of them."""
        self._sq_tail.value = self._sq_local_tail
        while pending := (self._sq_local_tail - self._sq_head.value) & _U32:
            try:
                _sys(_SYS_IO_URING_ENTER, self._fd, pending, 0, 0, 0, 0)
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    raise

    def _arm_wake(self) -> None:
        self._push(_sqe(_OP_READ, self._event_fd, 0, ctypes.addressof(self._wake_buffer), 8, 0,
                        _WAKE_ID))

    def _reap(self, done: list[IoCompletion]) -> bool:
        """Move every CQE into ``done`` (resubmitting EINTR/EAGAIN); True if woken."""
        head, tail = self._cq_head.value, self._cq_tail.value
        if head == tail:
            return False
        woken = requeued = False
        while head != tail:
            user_data, res, _ = _CQE.unpack_from(
                self._cq_map, self._cqes_offset + (head & self._cq_mask) * _CQE.size)
            head = (head + 1) & _U32
            if user_data == _WAKE_ID:
                woken = woken or res not in _RETRY
                self._arm_wake()
                requeued = True
                continue
            entry = self._ops.get(user_data)
            if entry is None:
                continue
            if res in _RETRY:
                self._push(entry[1])
                requeued = True
                continue
            del self._ops[user_data]
            self._in_flight -= 1
            done.append(IoCompletion(entry[0].token, res))
        self._cq_head.value = head
        if requeued:
            self._flush()
        return woken

    def _release(self) -> None:
        self._closed = True
        with self._wake_lock:
            if self._event_fd >= 0:
                os.close(self._event_fd)
                self._event_fd = -1
        self._ops.clear()
        for m in self._maps:
            m.close()
        self._maps.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


ASYNC_MIN_BYTES = 1 << 20
"""Reads and writes of at least this many bytes go to the kernel's io-wq workers (``IOSQE_ASYNC``)
instead of being issued inside ``io_uring_enter``. Issued inline, an O_DIRECT request pins its pages
and takes the device's request tags on the submitting thread, which sleeps when a device runs out of
tags, reaping no completions for any device meanwhile (docs/benchmarks.md, "The reactor's per-block
cost")."""


def _sqe(opcode: int, fd: int, off: int, addr: int, length: int, op_flags: int,
         user_data: int) -> tuple:
    """All 14 fields of ``_SQE`` in order; ioprio and the tail stay 0, flags ``IOSQE_ASYNC`` for
    a large read or write (``ASYNC_MIN_BYTES``)."""
    flags = _IOSQE_ASYNC if opcode in (_OP_READ, _OP_WRITE) and length >= ASYNC_MIN_BYTES else 0
    return (opcode, flags, 0, fd, off, addr, length, op_flags & _U32, user_data, 0, 0, 0, 0, 0)


def _prepare(request: IoRequest) -> tuple[tuple, object]:
    """Return ``(opcode, fd, off, addr, len, op_flags)`` for ``request`` and the
    object that must stay alive until it completes."""
    op, keep = request.op, None
    if op is OpKind.OPEN:
        path = os.fsencode(request.path)
        if b"\0" in path:
            raise ValueError(f"path contains a NUL byte: {path!r}")
        keep = ctypes.create_string_buffer(path)
        if request.resolve:  # OPENAT2: addr = path, len = sizeof(open_how), off = &open_how
            how = ctypes.create_string_buffer(open_how(request.flags, request.mode, request.resolve), OPEN_HOW.size)
            keep = (keep, how)
            fields = (_OP_OPENAT2, _AT_FDCWD, ctypes.addressof(how), ctypes.addressof(keep[0]), OPEN_HOW.size, 0)
        else:
            fields = (_OP_OPENAT, _AT_FDCWD, 0, ctypes.addressof(keep), request.mode, request.flags)
    elif op is OpKind.READ or op is OpKind.WRITE:
        if not 0 <= request.length <= _U32 or request.offset < 0 or request.address <= 0:
            raise ValueError(f"bad {op.value} request: address={request.address:#x} "
                             f"length={request.length} offset={request.offset}")
        fields = (_OP_READ if op is OpKind.READ else _OP_WRITE, request.fd, request.offset,
                  request.address, request.length, 0)
    elif op is OpKind.FSYNC:
        fields = (_OP_FSYNC, request.fd, 0, 0, 0, 0)
    elif op is OpKind.CLOSE:
        fields = (_OP_CLOSE, request.fd, 0, 0, 0, 0)
    else:
        raise ValueError(f"unsupported operation {op!r}")
    return fields, keep


def uring_available() -> tuple[bool, str]:
    """Set up a tiny ring and run one operation through it; return (ok, reason)."""
    if not sys.platform.startswith("linux"):
        return False, f"io_uring needs Linux (platform is {sys.platform})"
    try:
        with UringBackend(depth=1) as ring:
            ring.submit([IoRequest(OpKind.CLOSE, token="probe", fd=-1)])
            completions = ring.wait(1, timeout=5.0)
    except OSError as exc:
        return False, _explain(exc)
    if [c.result for c in completions] != [-errno.EBADF]:
        return False, f"io_uring probe operation gave {completions!r}, expected -EBADF"
    return True, "io_uring available"


def _explain(exc: OSError) -> str:
    if exc.errno == errno.EPERM:
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as f:
                setting = f"kernel.io_uring_disabled={f.read().strip()}"
        except OSError:
            setting = "kernel.io_uring_disabled"
        return f"io_uring_setup denied (EPERM): {setting} or a seccomp/container policy"
    if exc.errno == errno.ENOSYS:
        return "io_uring_setup not implemented (ENOSYS): kernel without io_uring or seccomp filter"
    if exc.errno == errno.ENOMEM:
        return "io_uring_setup failed (ENOMEM): locked-memory limit (ulimit -l) too low"
    return f"io_uring unusable: {exc}"
