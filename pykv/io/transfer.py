"""Synchronous whole-file transfers and batches on top of any ``IoBackend``.

For tests, benchmarks and the CLI; the reactor drives backends asynchronously.
Each call expects the backend to have nothing else in flight.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from typing import Sequence

from pykv.io.backend import IoBackend, IoCompletion, IoRequest, OpKind
from pykv.io.memory import ALIGNMENT

PathArg = str | bytes | os.PathLike


def run_batch(backend: IoBackend, requests: Sequence[IoRequest]) -> list[IoCompletion]:
    """Run ``requests`` keeping at most ``backend.depth`` in flight; return their
    completions in request order (tokens unchanged)."""
    results: list[int | None] = [None] * len(requests)
    pending = 0
    next_index = 0
    while next_index < len(requests) or pending:
        room = backend.depth - backend.in_flight
        if room > 0 and next_index < len(requests):
            chunk = requests[next_index:next_index + room]
            backend.submit([dataclasses.replace(r, token=next_index + i) for i, r in enumerate(chunk)])
            next_index += len(chunk)
            pending += len(chunk)
        for completion in backend.wait(1):
            results[completion.token] = completion.result
            pending -= 1
    return [IoCompletion(r.token, result) for r, result in zip(requests, results)]


def _run_one(backend: IoBackend, request: IoRequest) -> int:
    return run_batch(backend, [request])[0].result


def _check(result: int, action: str, path: bytes) -> int:
    if result < 0:
        raise OSError(-result, f"{action} failed: {os.strerror(-result)}", os.fsdecode(path))
    return result


def _close(backend: IoBackend, fd: int, path: bytes) -> None:
    _check(_run_one(backend, IoRequest(OpKind.CLOSE, "close", fd=fd)), "close", path)


def read_file(backend: IoBackend, path: PathArg, address: int, length: int, *,
              direct: bool = True) -> int:
    """Read up to ``length`` bytes from the start of ``path`` into ``address``.

    Short reads are continued until ``length`` bytes or end of file; returns the
    bytes read.  Opens with O_NOFOLLOW (and O_DIRECT when ``direct``: address and
    length must then be 4096-aligned).  Raises OSError naming the path.
    """
    raw = os.fsencode(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    fd = _check(_run_one(backend, IoRequest(OpKind.OPEN, "open", path=raw, flags=flags)), "open", raw)
    done = 0
    try:
        while done < length:
            got = _check(_run_one(backend, IoRequest(
                OpKind.READ, "read", fd=fd, address=address + done, length=length - done,
                offset=done)), "read", raw)
            done += got
            # EOF; with O_DIRECT an unaligned count also means EOF (and continuing
            # at an unaligned offset would fail with EINVAL).
            if got == 0 or (direct and done % ALIGNMENT):
                break
    finally:
        _close(backend, fd, raw)
    return done


def write_file(backend: IoBackend, path: PathArg, address: int, length: int, *,
               direct: bool = True, fsync: bool = False,
               flags: int = os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode: int = 0o600) -> int:
    """Write ``length`` bytes at ``address`` to the start of ``path``; return ``length``.

    Short writes are continued; ``fsync`` flushes before closing.  With ``direct``,
    O_DIRECT is added (address and length must be 4096-aligned).  On failure a
    file this call created with O_CREAT|O_EXCL is removed; raises OSError naming
    the path.
    """
    raw = os.fsencode(path)
    flags |= os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    created = flags & os.O_CREAT and flags & os.O_EXCL
    fd = _check(_run_one(backend, IoRequest(OpKind.OPEN, "open", path=raw, flags=flags, mode=mode)),
                "open", raw)
    ok = False
    try:
        done = 0
        while done < length:
            wrote = _check(_run_one(backend, IoRequest(
                OpKind.WRITE, "write", fd=fd, address=address + done, length=length - done,
                offset=done)), "write", raw)
            if wrote == 0:
                raise OSError(errno.EIO, "write made no progress", os.fsdecode(raw))
            done += wrote
        if fsync:
            _check(_run_one(backend, IoRequest(OpKind.FSYNC, "fsync", fd=fd)), "fsync", raw)
        ok = True
    finally:
        try:
            _close(backend, fd, raw)
        finally:
            if not ok and created:
                try:
                    os.unlink(raw)
                except OSError:
                    pass
    return length
