"""``start_daemon_threads``: a device's daemon threads, the process's thread limit no error."""

from __future__ import annotations

import logging
import threading

import pytest

from pykv import daemon_threads
from pykv.daemon_threads import start_daemon_threads


def test_starts_named_daemon_threads_running_the_target():
    ran, gate = [], threading.Event()

    def work() -> None:
        ran.append(threading.current_thread().name)
        gate.wait(5)

    threads = start_daemon_threads(work, 3, "pykv-test-2")
    gate.set()
    for thread in threads:
        thread.join(5)
    assert [t.name for t in threads] == ["pykv-test-2-0", "pykv-test-2-1", "pykv-test-2-2"]
    assert all(t.daemon for t in threads) and sorted(ran) == [t.name for t in threads]


@pytest.mark.parametrize("allowed", [0, 1])
def test_the_thread_limit_keeps_the_threads_started_so_far(monkeypatch, caplog, allowed):
    class Limited(threading.Thread):
        started = 0

        def start(self) -> None:
            if Limited.started >= allowed:
                raise RuntimeError("can't start new thread")
            Limited.started += 1
            super().start()

    monkeypatch.setattr(daemon_threads.threading, "Thread", Limited)
    with caplog.at_level(logging.WARNING, logger=daemon_threads.__name__):
        threads = start_daemon_threads(lambda: None, 3, "pykv-test")
    for thread in threads:
        thread.join(5)
    assert [t.name for t in threads] == [f"pykv-test-{n}" for n in range(allowed)]
    assert [r.getMessage() for r in caplog.records] == [f"pykv: thread pykv-test-{allowed} not started (can't start new thread)"]
