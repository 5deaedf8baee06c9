"""Thread-pool backend: ``depth`` worker threads running blocking syscalls.

The fallback where io_uring is unavailable (``kernel.io_uring_disabled``, seccomp,
old kernels).  Workers call ``os.open``/``os.preadv``/``os.pwritev``/``os.fsync``/
``os.close``, which release the GIL; raw addresses are wrapped as ctypes arrays so
data moves straight into the caller's memory.  On large requests this reaches the
same bandwidth as io_uring on our disks (see IO_NOTES.md).

Unlike io_uring's OPENAT, ``os.open`` always makes the new fd close-on-exec.
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
import time
from typing import Sequence

from pykv.io.backend import IoBackend, IoCompletion, IoRequest, OpKind
from pykv.io.openat2 import openat2

_WAKE = object()  # marker put on the completion queue by ``wake``
_STOP = object()  # marker that ends a worker
_RETRY = (errno.EINTR, errno.EAGAIN)


def _memory(address: int, length: int) -> memoryview:
    """A writable view of ``length`` bytes at raw ``address``."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def _execute(request: IoRequest) -> int:
    """Run one request; return its result or ``-errno``. EINTR/EAGAIN are retried."""
    op = request.op
    while True:
        try:
            if op is OpKind.READ:
                return os.preadv(request.fd, [_memory(request.address, request.length)],
                                 request.offset)
            if op is OpKind.WRITE:
                return os.pwritev(request.fd, [_memory(request.address, request.length)],
                                  request.offset)
            if op is OpKind.OPEN:
                if request.resolve:
                    return openat2(request.path, request.flags, request.mode, request.resolve)
                return os.open(request.path, request.flags, request.mode)
            if op is OpKind.FSYNC:
                os.fsync(request.fd)
                return 0
            if op is OpKind.CLOSE:
                os.close(request.fd)
                return 0
            return -errno.EINVAL
        except OSError as exc:
            if exc.errno in _RETRY:
                time.sleep(0)
                continue
            return -(exc.errno or errno.EIO)


class ThreadPoolBackend(IoBackend):
    """Asynchronous file I/O on ``depth`` threads; completions come back through a queue."""

    name = "threadpool"

    def __init__(self, depth: int = 64) -> None:
        super().__init__(depth)
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._completions: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [
            threading.Thread(target=self._work, name=f"pykv-io-{i}", daemon=True)
            for i in range(depth)
        ]
        for worker in self._workers:
            worker.start()

    def _work(self) -> None:
        while (request := self._requests.get()) is not _STOP:
            self._completions.put(IoCompletion(request.token, _execute(request)))

    def submit(self, requests: Sequence[IoRequest]) -> None:
        self._admit(requests)
        for request in requests:
            _validate(request)
        for request in requests:
            self._requests.put(request)
        self._in_flight += len(requests)

    def wait(self, min_completions: int = 1, timeout: float | None = None) -> list[IoCompletion]:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        done: list[IoCompletion] = []
        while True:
            try:  # take everything already there without blocking
                while True:
                    item = self._completions.get_nowait()
                    if item is _WAKE:
                        return done
                    self._in_flight -= 1
                    done.append(item)
            except queue.Empty:
                pass
            if len(done) >= min_completions:
                return done
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return done
            try:
                item = self._completions.get(timeout=remaining)
            except queue.Empty:
                return done
            if item is _WAKE:
                return done
            self._in_flight -= 1
            done.append(item)

    def wake(self) -> None:
        self._completions.put(_WAKE)

    def _release(self) -> None:
        for _ in self._workers:
            self._requests.put(_STOP)
        for worker in self._workers:
            worker.join()


def _validate(request: IoRequest) -> None:
    if request.op is OpKind.READ or request.op is OpKind.WRITE:
        if request.length < 0 or request.offset < 0 or request.address <= 0:
            raise ValueError(f"bad {request.op.value} request: address={request.address:#x} "
                             f"length={request.length} offset={request.offset}")
    elif request.op is OpKind.OPEN and b"\0" in os.fsencode(request.path):
        raise ValueError(f"path contains a NUL byte: {request.path!r}")
