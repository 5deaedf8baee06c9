"""Thread-pool specifics; the shared contract tests are in ``test_io_backends.py``."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from pykv.io.backend import IoRequest, OpKind
from pykv.io.threadpool import ThreadPoolBackend


def test_named_and_workers_stop_on_close() -> None:
    before = threading.active_count()
    backend = ThreadPoolBackend(6)
    assert backend.name == "threadpool" and backend.depth == 6
    assert threading.active_count() == before + 6
    backend.close()
    assert threading.active_count() == before


def test_bad_requests_rejected_before_queueing() -> None:
    with ThreadPoolBackend(2) as backend:
        with pytest.raises(ValueError):
            backend.submit([IoRequest(OpKind.WRITE, "w", fd=0, address=0, length=1)])
        assert backend.in_flight == 0


def test_zero_length_read(tmp_path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    buf = bytearray(1)
    address = ctypes.addressof((ctypes.c_char * 1).from_buffer(buf))
    with ThreadPoolBackend(1) as backend:
        backend.submit([IoRequest(OpKind.READ, "r", fd=fd, address=address, length=0)])
        assert [(c.token, c.result) for c in backend.wait(1, timeout=5)] == [("r", 0)]
    os.close(fd)
