"""``pykv.counters.CounterFile``: counter files written off the caller's thread, coalesced, never fatal."""

from __future__ import annotations

from pykv.counters import CounterFile, WorkerCounter


def test_a_counter_file_is_written_off_the_callers_thread_latest_snapshot_last(tmp_path, monkeypatch):
    import threading

    from pykv import counters
    gate, writers, written = threading.Event(), set(), []

    def slow_write(path, content, durable=True):
        writers.add(threading.current_thread().name)
        gate.wait(10)
        written.append(content)
        (tmp_path / "out.json").write_text(content)
    monkeypatch.setattr(counters, "write_atomically", slow_write)
    f = CounterFile("worker0", base=str(tmp_path / "engine.stats"))
    for n in range(1, 6):  # the first write holds the writer; the next four wait, coalesced
        f.write({WorkerCounter.STORE_PUBLISHED: n})
    assert not f.flush(timeout=0.05)  # still writing
    f.write({WorkerCounter.STORE_PUBLISHED: 5})  # unchanged: no new write
    gate.set()
    assert f.flush()
    assert writers and threading.current_thread().name not in writers
    assert written[-1] == '{"store_published": 5}' and len(written) <= 2


def test_a_counter_file_that_cannot_be_written_warns_once_and_serving_goes_on(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    f = CounterFile("worker0", base=str(blocker / "sub" / "engine.stats"))  # a parent that is a file
    for n in range(3):
        f.write({WorkerCounter.STORE_PUBLISHED: n})
        assert f.flush()
    assert [r.levelname for r in caplog.records if "counter file" in r.getMessage()] == ["WARNING"]


def test_a_counter_file_changed_at_interpreter_shutdown_is_written_at_once(tmp_path, monkeypatch):
    import json
    import threading

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    f = CounterFile("worker0", base=str(tmp_path / "engine.stats"))
    f.write({WorkerCounter.STORE_PUBLISHED: 4})
    assert json.loads((tmp_path / "engine.stats.worker0.json").read_text()) == {"store_published": 4}
    assert f.flush(timeout=0.1)
