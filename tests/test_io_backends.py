"""Contract tests shared by every I/O backend (io_uring and threadpool), on real files."""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Iterator

import pytest

from pykv.io.backend import IoBackend, IoRequest, OpKind
from pykv.io.memory import aligned_buffer, buffer_address
from pykv.io.probe import direct_io_supported
from pykv.io.threadpool import ThreadPoolBackend
from pykv.io.transfer import read_file, run_batch, write_file
from pykv.io.uring import UringBackend, uring_available

BLOCK = 64 * 1024


def make_backend(kind: str, depth: int) -> IoBackend:
    if kind == "io_uring":
        ok, reason = uring_available()
        if not ok:
            pytest.skip(f"io_uring unavailable: {reason}")
        backend: IoBackend = UringBackend(depth)
        assert backend.name == "io_uring"
        return backend
    return ThreadPoolBackend(depth)


@pytest.fixture(params=["io_uring", "threadpool"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def backend(kind: str) -> Iterator[IoBackend]:
    with make_backend(kind, 16) as b:
        yield b


@pytest.fixture
def direct_dir(tmp_path) -> str:
    ok, reason = direct_io_supported(tmp_path)
    assert ok, reason  # tmp_path is on ext4 here
    return str(tmp_path)


def one(backend: IoBackend, request: IoRequest) -> int:
    return run_batch(backend, [request])[0].result


def open_req(path: str, flags: int, mode: int = 0o600, token: object = "open") -> IoRequest:
    return IoRequest(OpKind.OPEN, token, path=os.fsencode(path), flags=flags, mode=mode)


@pytest.mark.parametrize("depth", [1, 16])
def test_round_trip_many_in_flight(kind: str, depth: int, direct_dir: str) -> None:
    blocks = 48
    data = os.urandom(blocks * BLOCK)
    out, back = aligned_buffer(len(data)), aligned_buffer(len(data))
    out[:] = data
    src, dst = buffer_address(out), buffer_address(back)
    path = os.path.join(direct_dir, "blocks.bin")
    with make_backend(kind, depth) as b:
        fd = one(b, open_req(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT))
        assert fd >= 0
        writes = [IoRequest(OpKind.WRITE, ("w", i), fd=fd, address=src + i * BLOCK,
                            length=BLOCK, offset=i * BLOCK) for i in reversed(range(blocks))]
        done = run_batch(b, writes)
        assert [c.token for c in done] == [r.token for r in writes]
        assert all(c.result == BLOCK for c in done)
        assert one(b, IoRequest(OpKind.FSYNC, "fsync", fd=fd)) == 0
        assert one(b, IoRequest(OpKind.CLOSE, "close", fd=fd)) == 0
        assert b.in_flight == 0

        fd = one(b, open_req(path, os.O_RDONLY | os.O_DIRECT))
        reads = [IoRequest(OpKind.READ, i, fd=fd, address=dst + i * BLOCK, length=BLOCK,
                           offset=i * BLOCK) for i in range(blocks)]
        assert all(c.result == BLOCK for c in run_batch(b, reads))
        assert one(b, IoRequest(OpKind.CLOSE, "close", fd=fd)) == 0
    assert back[:] == data


@pytest.mark.parametrize("length", [1 << 20, 3 << 20])
def test_large_requests_round_trip(kind: str, length: int, direct_dir: str) -> None:
    # io_uring issues requests of ASYNC_MIN_BYTES and more from io-wq (IOSQE_ASYNC): same bytes back
    data = os.urandom(2 * length)
    out, back = aligned_buffer(len(data), populate=True), aligned_buffer(len(data))
    out[:] = data
    path = os.path.join(direct_dir, "large.bin")
    with make_backend(kind, 4) as b:
        fd = one(b, open_req(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT))
        writes = [IoRequest(OpKind.WRITE, ("w", i), fd=fd, address=buffer_address(out) + i * length,
                            length=length, offset=i * length) for i in range(2)]
        assert all(c.result == length for c in run_batch(b, writes))
        assert one(b, IoRequest(OpKind.CLOSE, "close", fd=fd)) == 0
        fd = one(b, open_req(path, os.O_RDONLY | os.O_DIRECT))
        reads = [IoRequest(OpKind.READ, i, fd=fd, address=buffer_address(back) + i * length, length=length,
                           offset=i * length) for i in range(2)]
        assert all(c.result == length for c in run_batch(b, reads))
        assert one(b, IoRequest(OpKind.CLOSE, "close", fd=fd)) == 0
    assert back[:] == data


def test_many_files_open_concurrently(backend: IoBackend, tmp_path) -> None:
    paths = [str(tmp_path / f"f{i}") for i in range(40)]
    opened = run_batch(backend, [open_req(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, token=p)
                                 for p in paths])
    fds = [c.result for c in opened]
    assert all(fd >= 0 for fd in fds) and len(set(fds)) == len(fds)
    closed = run_batch(backend, [IoRequest(OpKind.CLOSE, fd, fd=fd) for fd in fds])
    assert all(c.result == 0 for c in closed)
    assert all(os.path.exists(p) for p in paths)


def test_unaligned_direct_io_gives_einval(backend: IoBackend, direct_dir: str) -> None:
    path = os.path.join(direct_dir, "x")
    buf = aligned_buffer(2 * 4096)
    fd = one(backend, open_req(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT))
    try:
        result = one(backend, IoRequest(OpKind.WRITE, "w", fd=fd,
                                        address=buffer_address(buf) + 16, length=4096))
        assert result == -errno.EINVAL
    finally:
        assert one(backend, IoRequest(OpKind.CLOSE, "c", fd=fd)) == 0


def test_missing_file_gives_enoent(backend: IoBackend, tmp_path) -> None:
    assert one(backend, open_req(str(tmp_path / "missing"), os.O_RDONLY)) == -errno.ENOENT


def test_nofollow_symlink_gives_eloop(backend: IoBackend, tmp_path) -> None:
    (tmp_path / "target").write_bytes(b"x")
    os.symlink(tmp_path / "target", tmp_path / "link")
    flags = os.O_RDONLY | os.O_NOFOLLOW
    assert one(backend, open_req(str(tmp_path / "link"), flags)) == -errno.ELOOP


def test_bad_fd_gives_ebadf(backend: IoBackend) -> None:
    assert one(backend, IoRequest(OpKind.FSYNC, "f", fd=987654)) == -errno.EBADF


def test_short_read_at_eof_reported(backend: IoBackend, tmp_path) -> None:
    path = tmp_path / "small"
    path.write_bytes(b"abc")
    buf = aligned_buffer(4096)
    fd = one(backend, open_req(str(path), os.O_RDONLY))
    assert one(backend, IoRequest(OpKind.READ, "r", fd=fd, address=buffer_address(buf),
                                  length=4096)) == 3
    assert one(backend, IoRequest(OpKind.CLOSE, "c", fd=fd)) == 0
    assert buf[:3] == b"abc"


def test_wake_from_other_thread_unblocks_wait(backend: IoBackend) -> None:
    timer = threading.Timer(0.2, backend.wake)
    start = time.monotonic()
    timer.start()
    assert backend.wait(1, timeout=None) == []
    assert 0.15 < time.monotonic() - start < 1.0
    timer.join()


def test_wake_before_wait_returns_promptly(backend: IoBackend) -> None:
    backend.wake()
    start = time.monotonic()
    assert backend.wait(1, timeout=5.0) == []
    assert time.monotonic() - start < 1.0
    # the wake is used up: the next wait runs to its timeout
    start = time.monotonic()
    assert backend.wait(1, timeout=0.1) == []
    assert time.monotonic() - start >= 0.09


def test_wait_timeout_returns_empty(backend: IoBackend) -> None:
    start = time.monotonic()
    assert backend.wait(1, timeout=0.25) == []
    assert 0.24 <= time.monotonic() - start < 1.0
    assert backend.wait(0) == []  # non-blocking poll


def test_in_flight_accounting(backend: IoBackend, tmp_path) -> None:
    path = tmp_path / "data"
    path.write_bytes(os.urandom(8 * 4096))
    buf = aligned_buffer(8 * 4096)
    fd = one(backend, open_req(str(path), os.O_RDONLY))
    reads = [IoRequest(OpKind.READ, i, fd=fd, address=buffer_address(buf) + i * 4096,
                       length=4096, offset=i * 4096) for i in range(8)]
    assert backend.depth == 16
    backend.submit(reads)
    assert backend.in_flight == 8
    with pytest.raises(ValueError):
        backend.submit(reads + reads[:1])  # 8 + 9 > depth
    assert backend.in_flight == 8
    got = []
    while len(got) < 8:
        got += backend.wait(1, timeout=5.0)
        assert backend.in_flight == 8 - len(got)
    assert sorted(c.token for c in got) == list(range(8))
    assert one(backend, IoRequest(OpKind.CLOSE, "c", fd=fd)) == 0
    assert buf[:] == path.read_bytes()


def test_close_idle_and_twice(kind: str) -> None:
    b = make_backend(kind, 4)
    b.close()
    b.close()
    with pytest.raises(ValueError):
        b.submit([IoRequest(OpKind.CLOSE, "c", fd=-1)])
    b.wake()  # harmless after close


def test_close_waits_for_in_flight(kind: str, tmp_path) -> None:
    path = tmp_path / "data"
    path.write_bytes(b"z" * 4096)
    buf = aligned_buffer(4096)
    b = make_backend(kind, 4)
    fd = os.open(path, os.O_RDONLY)
    b.submit([IoRequest(OpKind.READ, "r", fd=fd, address=buffer_address(buf), length=4096)])
    b.close()
    os.close(fd)
    assert buf[:] == b"z" * 4096


def test_read_write_file_helpers(backend: IoBackend, direct_dir: str) -> None:
    data = os.urandom(3 * BLOCK)
    out, back = aligned_buffer(len(data)), aligned_buffer(4 * BLOCK)
    out[:] = data
    path = os.path.join(direct_dir, "file.bin")
    assert write_file(backend, path, buffer_address(out), len(data), fsync=True) == len(data)
    assert os.stat(path).st_mode & 0o777 == 0o600
    # asking for more than the file holds stops at EOF
    assert read_file(backend, path, buffer_address(back), 4 * BLOCK) == len(data)
    assert back[:len(data)] == data
    with pytest.raises(FileExistsError):
        write_file(backend, path, buffer_address(out), len(data))
    assert backend.in_flight == 0


def test_helpers_raise_with_path(backend: IoBackend, direct_dir: str) -> None:
    buf = aligned_buffer(4096)
    missing = os.path.join(direct_dir, "missing")
    with pytest.raises(FileNotFoundError) as info:
        read_file(backend, missing, buffer_address(buf), 4096)
    assert info.value.filename == missing
    bad = os.path.join(direct_dir, "unaligned")
    with pytest.raises(OSError) as info:
        write_file(backend, bad, buffer_address(buf) + 8, 4096)
    assert info.value.errno == errno.EINVAL and info.value.filename == bad
    assert not os.path.exists(bad)  # the file it created is removed
    assert backend.in_flight == 0


def test_buffered_read_of_unaligned_tail(backend: IoBackend, tmp_path) -> None:
    data = os.urandom(10_000)
    (tmp_path / "odd").write_bytes(data)
    buf = aligned_buffer(16384)
    assert read_file(backend, tmp_path / "odd", buffer_address(buf), 16384, direct=False) == 10_000
    assert buf[:10_000] == data
