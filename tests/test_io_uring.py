"""io_uring specifics: the ring really is io_uring, waits release the GIL, EINTR and probing.

The shared contract tests run on both backends in ``test_io_backends.py``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import threading
import time

import pytest

from pykv.io import uring
from pykv.io.backend import IoRequest, OpKind
from pykv.io.uring import UringBackend, uring_available

pytestmark = pytest.mark.skipif(not uring_available()[0],
                                reason=f"io_uring unavailable: {uring_available()[1]}")


def test_available_and_named() -> None:
    assert uring_available() == (True, "io_uring available")
    with UringBackend(8) as ring:
        assert ring.name == "io_uring"
        assert ring.depth == 8
        assert os.readlink(f"/proc/self/fd/{ring._fd}") == "anon_inode:[io_uring]"


@pytest.mark.parametrize("depth, entries", [(1, 2), (3, 4), (4, 8), (63, 64), (64, 128)])
def test_ring_entries_leave_room_for_wake(depth: int, entries: int) -> None:
    with UringBackend(depth) as ring:
        assert ring._sq_entries == entries


def test_wait_releases_the_gil() -> None:
    counter = 0
    stop = False

    def spin() -> None:
        nonlocal counter
        while not stop:
            counter += 1

    with UringBackend(4) as ring:
        thread = threading.Thread(target=spin)
        thread.start()
        time.sleep(0.05)
        before = counter
        time.sleep(0.3)  # baseline: time.sleep releases the GIL
        baseline = counter - before
        before = counter
        ring.wait(1, timeout=0.3)
        during = counter - before
        stop = True
        thread.join()
    # the other thread ran about as freely while we sat in io_uring_enter
    assert during > 0.3 * baseline > 0


def test_wait_survives_signals() -> None:
    """EINTR from io_uring_enter is retried and the timeout still holds."""
    hits = []
    old = signal.signal(signal.SIGALRM, lambda *_: hits.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
    try:
        with UringBackend(4) as ring:
            start = time.monotonic()
            assert ring.wait(1, timeout=0.3) == []
            elapsed = time.monotonic() - start
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    assert hits and 0.29 <= elapsed < 1.0


def test_eagain_completion_is_resubmitted(monkeypatch, tmp_path) -> None:
    """A -EAGAIN CQE is resubmitted, not returned."""
    path = tmp_path / "f"
    path.write_bytes(b"a" * 4096)
    fd = os.open(path, os.O_RDONLY)
    ring = UringBackend(4)
    real_unpack = uring._CQE.unpack_from
    faked = []

    class FakeCqe:
        size = uring._CQE.size

        @staticmethod
        def unpack_from(buffer, offset):
            user_data, res, flags = real_unpack(buffer, offset)
            if user_data != uring._WAKE_ID and not faked:
                faked.append(res)
                return user_data, -errno.EAGAIN, flags
            return user_data, res, flags

    monkeypatch.setattr(uring, "_CQE", FakeCqe)
    try:
        buf = bytearray(4096)
        address = ctypes.addressof((ctypes.c_char * 4096).from_buffer(buf))
        ring.submit([IoRequest(OpKind.READ, "r", fd=fd, address=address, length=4096)])
        done = []
        while not done:
            done = ring.wait(1, timeout=5.0)
        assert faked == [4096]
        assert [(c.token, c.result) for c in done] == [("r", 4096)]
        assert ring.in_flight == 0
    finally:
        ring.close()
        os.close(fd)


def test_probe_reports_why(monkeypatch) -> None:
    def deny(*args: int) -> int:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(uring, "_sys", deny)
    ok, reason = uring_available()
    assert not ok and "EPERM" in reason and "io_uring_disabled" in reason

    monkeypatch.setattr(uring, "_sys", lambda *a: (_ for _ in ()).throw(
        OSError(errno.ENOSYS, "nope")))
    ok, reason = uring_available()
    assert not ok and "ENOSYS" in reason


def test_bad_requests_rejected_before_queueing() -> None:
    with UringBackend(4) as ring:
        with pytest.raises(ValueError):
            ring.submit([IoRequest(OpKind.CLOSE, "ok", fd=-1),
                         IoRequest(OpKind.OPEN, "bad", path=b"a\0b")])
        assert ring.in_flight == 0
        with pytest.raises(ValueError):
            ring.submit([IoRequest(OpKind.READ, "r", fd=0, address=0, length=4096)])
        assert ring.in_flight == 0


def test_large_reads_and_writes_go_to_io_wq_small_ones_and_other_ops_inline() -> None:
    big, small = uring.ASYNC_MIN_BYTES, uring.ASYNC_MIN_BYTES - 4096
    flags = lambda op, length: uring._sqe(op, 3, 0, 0, length, 0, 1)[1]  # noqa: E731
    assert flags(uring._OP_READ, big) == uring._IOSQE_ASYNC == 1 << 4
    assert flags(uring._OP_WRITE, 28 << 20) == uring._IOSQE_ASYNC
    assert flags(uring._OP_READ, small) == 0 and flags(uring._OP_WRITE, 4096) == 0
    assert flags(uring._OP_OPENAT2, big) == 0 and flags(uring._OP_CLOSE, big) == 0
    read = IoRequest(OpKind.READ, "r", fd=3, address=4096, length=28 << 20, offset=0)
    assert uring._sqe(*uring._prepare(read)[0], 1)[1] == uring._IOSQE_ASYNC
