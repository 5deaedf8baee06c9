"""Backend selection and the O_DIRECT probe."""

from __future__ import annotations

import logging
import os

import pytest

from pykv.io import probe
from pykv.io.probe import BackendUnavailable, direct_io_supported, open_backend
from pykv.io.uring import uring_available


def test_auto_picks_io_uring_here(tmp_path, caplog) -> None:
    if not uring_available()[0]:
        pytest.skip(f"io_uring unavailable: {uring_available()[1]}")
    with caplog.at_level(logging.WARNING, logger="pykv.io.probe"):
        with open_backend("auto", 8, directory=str(tmp_path)) as backend:
            assert backend.name == "io_uring" and backend.depth == 8
            assert backend.in_flight == 0
    assert caplog.records == []


def test_auto_falls_back_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(probe, "uring_available", lambda: (False, "disabled for the test"))
    with caplog.at_level(logging.WARNING, logger="pykv.io.probe"):
        with open_backend("auto", 4) as backend:
            assert backend.name == "threadpool" and backend.depth == 4
    assert len(caplog.records) == 1
    assert "disabled for the test" in caplog.records[0].getMessage()
    assert caplog.records[0].levelno == logging.WARNING


def test_forced_io_uring_unavailable_raises(monkeypatch) -> None:
    monkeypatch.setattr(probe, "uring_available", lambda: (False, "disabled for the test"))
    with pytest.raises(BackendUnavailable, match="disabled for the test"):
        open_backend("io_uring")


def test_forced_threadpool_and_unknown_kind(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        with open_backend("threadpool", 2) as backend:
            assert backend.name == "threadpool"
    assert caplog.records == []
    with pytest.raises(ValueError, match="unknown I/O backend"):
        open_backend("spdk")


def test_missing_directory_is_an_error_not_a_fallback(tmp_path) -> None:
    if not uring_available()[0]:
        pytest.skip("io_uring unavailable")
    with pytest.raises(FileNotFoundError):
        open_backend("auto", 4, directory=str(tmp_path / "nope"))


def test_direct_io_supported_on_ext4_tmp_path(tmp_path) -> None:
    ok, reason = direct_io_supported(tmp_path)
    assert ok, reason
    assert os.listdir(tmp_path) == []  # the probe file is removed


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_direct_io_refused_on_tmpfs() -> None:
    before = set(os.listdir("/dev/shm"))
    ok, reason = direct_io_supported("/dev/shm")
    assert not ok and "O_DIRECT" in reason
    assert set(os.listdir("/dev/shm")) == before


def test_direct_io_missing_directory(tmp_path) -> None:
    ok, reason = direct_io_supported(tmp_path / "missing")
    assert not ok and "cannot create" in reason
