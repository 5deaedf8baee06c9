"""``FanOut``: a blocking call over many items on a few threads, results in order."""

from __future__ import annotations

import threading
import time

import pytest

from pykv.fanout import INLINE_MAX, THREAD_PREFIX, FanOut, lookup_threads


def test_results_come_back_in_the_items_order_whatever_the_threads_finish_first():
    fan = FanOut(4)
    try:
        items = list(range(50))
        assert fan.map(lambda i: (time.sleep(0.001 * (i % 3)), i * i)[1], items) == [i * i for i in items]
        assert fan.map(str, []) == []
    finally:
        fan.close()


def test_a_short_list_runs_inline_and_a_long_one_on_the_threads_at_once():
    fan = FanOut(4)
    try:
        assert fan.map(lambda _: threading.current_thread().name, list(range(INLINE_MAX))) == \
            [threading.current_thread().name] * INLINE_MAX
        barrier = threading.Barrier(4, timeout=5)  # only passes when four calls run at the same time

        def call(i: int) -> str:
            if i < 4:
                barrier.wait()
            return threading.current_thread().name
        names = fan.map(call, list(range(40)))
        assert all(name.startswith(THREAD_PREFIX) for name in names) and len(set(names)) == 4
    finally:
        fan.close()
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def test_an_exception_of_the_call_propagates_as_inline():
    fan = FanOut(3)
    try:
        def call(i: int) -> int:
            if i == 17:
                raise OSError("boom")
            return i
        with pytest.raises(OSError, match="boom"):
            fan.map(call, list(range(30)))
        assert fan.map(call, list(range(10))) == list(range(10))
    finally:
        fan.close()


def test_thread_counts():
    assert [lookup_threads(n) for n in (1, 2, 3, 8, 9, 64)] == [4, 4, 6, 16, 16, 16]
    with pytest.raises(ValueError):
        FanOut(0)
    assert FanOut(1).map(lambda i: i + 1, list(range(20))) == list(range(1, 21))


def test_no_thread_to_be_had_runs_the_calls_inline_with_one_warning(monkeypatch, caplog):
    import concurrent.futures
    import logging

    def refuse(self, *args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", refuse)
    fan = FanOut(4)
    caller = threading.current_thread()
    ran_on = set()

    def call(item):
        ran_on.add(threading.current_thread())
        return item * 2

    with caplog.at_level(logging.WARNING, logger="pykv.fanout"):
        assert fan.map(call, list(range(40))) == [i * 2 for i in range(40)]
        assert fan.map(call, list(range(20))) == [i * 2 for i in range(20)]
    assert ran_on == {caller}
    assert sum("no lookup thread could be started" in r.getMessage() for r in caplog.records) == 1
    fan.close()


def test_start_returns_before_the_calls_run_and_every_item_is_called_once(caplog):
    fan = FanOut(4)
    release, seen, lock = threading.Event(), [], threading.Lock()

    def call(i: int) -> None:
        assert release.wait(5)
        if i == 3:
            raise OSError("gone")  # logged; the others go on
        with lock:
            seen.append(i)
    try:
        fan.start(call, list(range(40)))
        assert seen == []  # nothing ran yet: start did not wait
        release.set()
    finally:
        fan.close()  # waits for what was started
    assert sorted(seen) == [i for i in range(40) if i != 3]
    assert "background call call failed" in caplog.text


def test_start_of_a_short_list_runs_inline():
    fan = FanOut(4)
    names: list[str] = []
    fan.start(lambda _: names.append(threading.current_thread().name), list(range(INLINE_MAX)))
    assert names == [threading.current_thread().name] * INLINE_MAX
    fan.close()


def test_start_runs_here_what_it_could_not_hand_to_a_thread_and_each_item_once(monkeypatch):
    import concurrent.futures
    submit, handed = concurrent.futures.ThreadPoolExecutor.submit, []

    def second_refused(self, *args, **kwargs):
        if handed:
            raise RuntimeError("can't start new thread")
        handed.append(1)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", second_refused)
    fan, seen, lock = FanOut(4), [], threading.Lock()

    def call(i: int) -> None:
        with lock:
            seen.append(i)
    fan.start(call, list(range(40)))
    fan.close()
    assert sorted(seen) == list(range(40))  # one part on a thread, the other three here, none twice
