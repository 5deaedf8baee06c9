"""The medium's blocking calls run on each device's own threads (``pykv.reactor.fileops``): one held
on a stalled device holds that device's blocks only, the reactor serves the others, the held calls
end their blocks as usual when released, and ``close(timeout)`` reports what still hangs."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from test_reactor_lanes import Client, as_loads, close, make_reactor, pattern, store_blocks
from test_store import KEYS, NS as STORE_NS, payload, store, submit  # noqa: F401 (store: the fixture)

from pykv.failures import Step
from pykv.format import HEADER_SIZE
from pykv.io.probe import open_backend
from pykv.media import PosixMedium
from pykv.namespace import Namespace
from pykv.reactor.fileops import THREAD_PREFIX, FileCalls, Outcome
from pykv.tree import KVTree, is_temp_name

NS = Namespace("tiny", "bf16", "test", 64)  # test_reactor_lanes' namespace


class GatedDevices(PosixMedium):
    """One tree seen as two devices: the blocks in ``stalled`` live on lane 0, the others on lane 1.
    Once ``armed``, the call named ``held`` on a stalled block waits for ``gate`` (a hung mount);
    every blocking call records the thread it ran on."""

    def __init__(self, tree: KVTree, held: str) -> None:
        super().__init__(tree)
        self.held, self.armed, self.stalled = held, False, set()
        self.gate, self.holding = threading.Event(), threading.Event()
        self.threads: list[str] = []

    @property
    def lanes(self) -> int:
        return 2

    def lane(self, location: Path) -> int:
        return 0 if Path(location) in self.stalled else 1

    def _enter(self, name: str, location: Path) -> None:
        self.threads.append(threading.current_thread().name)
        if self.armed and name == self.held and Path(location) in self.stalled:
            self.holding.set()
            assert self.gate.wait(30)

    def check_opened(self, fd: int) -> int:
        self._enter("check_opened", Path(os.readlink(f"/proc/self/fd/{fd}")))
        return super().check_opened(fd)

    def prepare_write(self, location: Path):
        self._enter("prepare_write", location)
        return super().prepare_write(location)

    def publish(self, temp: Path, location: Path) -> bool:
        self._enter("publish", location)
        return super().publish(temp, location)


@pytest.mark.parametrize("held", ["check_opened", "prepare_write", "publish"])
def test_a_call_held_on_one_device_holds_its_blocks_only_and_close_reports_it(tmp_path, held):
    tree = KVTree.create(tmp_path.resolve() / "tree")
    tree.ensure_namespace(NS)
    slow, fast = store_blocks(tree, 0, 3), store_blocks(tree, 100, 5)
    medium = GatedDevices(tree, held)
    medium.stalled = {b.path for b in slow}
    client = Client()
    reactor = make_reactor(tree, open_backend("auto", depth=64), medium, client, io_depth=2, open_ahead=2)
    closed = False
    try:
        if held == "check_opened":
            reactor.write("stored", slow + fast)
            assert reactor.wait_for("stored", timeout=30).ok
            medium.armed = True
            reactor.read("slow", as_loads(slow))
            reactor.read("fast", as_loads(fast))
        else:
            medium.armed = True
            reactor.write("slow", slow)
            reactor.write("fast", fast)
        fast_result = reactor.wait_for("fast", timeout=30)  # lane 1 ends while lane 0 hangs
        assert fast_result.ok and medium.holding.is_set()
        with pytest.raises(TimeoutError):
            reactor.wait_for("slow", timeout=0.2)
        began = time.monotonic()
        assert reactor.close(timeout=0.3) is False  # a call still hangs: the reactor keeps its memory
        assert time.monotonic() - began < 5
        medium.gate.set()
        slow_result = reactor.wait_for("slow", timeout=30)
        assert slow_result.ok
        if held == "check_opened":
            assert {i for job, i in client.payloads if job == "slow"} == {0, 1, 2}
            assert all(client.payloads["slow", i] == pattern(i) for i in range(3))
        else:
            assert slow_result.published == 3 and fast_result.published == 5
            assert all(tree.contains(NS.id, b.key) for b in slow + fast)
            assert not [p for p in tree.root.rglob("*") if is_temp_name(p.name)]
        closed = reactor.close(timeout=10)
        assert closed is True
        assert medium.threads and all(name.startswith(THREAD_PREFIX) for name in medium.threads)
    finally:
        medium.gate.set()
        if not closed:
            reactor.close(timeout=10)
        reactor.pool.close()


def test_a_file_refused_by_the_check_fails_its_open_and_is_never_read(tmp_path):
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    blocks = store_blocks(tree, 0, 2)
    blocks[1].path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(blocks[1].path)  # planted at the name of a block never stored
    client = Client()
    reactor = make_reactor(tree, open_backend("auto", depth=64), PosixMedium(tree), client)
    try:
        reactor.write("s", blocks[:1])
        assert reactor.wait_for("s", timeout=30).ok
        reactor.read("l", as_loads(blocks))
        result = reactor.wait_for("l", timeout=30)
        assert list(result.failed) == [1] and result.failed[1].step is Step.OPEN
        assert reactor.stats["disk_reads"] == 1 and client.payloads == {("l", 0): pattern(0)}
    finally:
        close(reactor)


# -- FileCalls ----------------------------------------------------------------------------------------
class Inbox:
    """Stands in for the reactor thread: ``post`` queues a command, ``serve`` runs what came."""

    def __init__(self) -> None:
        self.commands: list = []
        self.cond = threading.Condition()

    def post(self, command) -> None:
        with self.cond:
            self.commands.append(command)
            self.cond.notify_all()

    def serve(self, until, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            with self.cond:
                self.cond.wait_for(lambda: self.commands, max(0.0, deadline - time.monotonic()))
                commands, self.commands = self.commands, []
            assert commands or until(), "nothing came back in time"
            for command in commands:
                command()


def test_outcomes_come_back_on_the_posting_thread_errors_included_and_pending_counts_them():
    inbox = Inbox()
    calls = FileCalls(2, inbox.post)
    got: list[tuple[str, object]] = []
    ran_on: list[str] = []

    def fstat_missing():
        ran_on.append(threading.current_thread().name)
        return os.stat("/nonexistent/pykv")

    def note(outcome: Outcome) -> None:
        try:
            got.append(("ok", outcome.get()))
        except OSError as exc:
            got.append(("error", type(exc)))

    calls.run(0, lambda: 7, note)
    calls.run(1, fstat_missing, note)
    assert calls.pending == 2
    inbox.serve(lambda: len(got) == 2)
    assert sorted(got, key=str) == [("error", FileNotFoundError), ("ok", 7)] and calls.pending == 0
    assert len(ran_on) == 1 and ran_on[0].startswith(f"{THREAD_PREFIX}-1-")  # lane 1's thread
    assert calls.close(timeout=5)
    calls.start(0, lambda: threading.current_thread().name, lambda o: got.append(("after close", o.get())))
    assert got[-1] == ("after close", threading.current_thread().name)  # closed: on the caller's thread


def test_close_reports_a_hung_call_and_leaves_it_to_a_daemon_thread():
    gate, began = threading.Event(), threading.Event()
    calls = FileCalls(2, lambda command: command())
    ended: list[Outcome] = []
    calls.start(0, lambda: (began.set(), gate.wait(30))[1], ended.append)
    calls.start(1, lambda: "other lane", ended.append)
    assert began.wait(10)
    started = time.monotonic()
    assert calls.close(timeout=0.2) is False and time.monotonic() - started < 5
    workers = [t for t in threading.enumerate() if t.name.startswith(f"{THREAD_PREFIX}-0-")]
    assert workers and all(t.daemon for t in workers)
    gate.set()
    for t in workers:
        t.join(10)
    assert calls.threads_alive() == 0 and [o.get() for o in ended] == ["other lane", True]


# -- BlockStore's quarantine ------------------------------------------------------------------------
def test_a_quarantine_held_by_its_device_holds_neither_the_reactor_nor_the_job_end_order(store):  # noqa: F811
    s, client = store()
    submit(s, client, 1, KEYS, load=False)
    assert not client.wait(1).failures
    path = s.devices[0].block_path(STORE_NS.id, KEYS[0])
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 5)
        f.write(b"\x00\xff")
    gate, moving, moved_on = threading.Event(), threading.Event(), []
    real = s.medium.quarantine

    def held(location, run):
        moved_on.append(threading.current_thread().name)
        moving.set()
        assert gate.wait(30)
        return real(location, run)

    s.medium.quarantine = held
    try:
        submit(s, client, 2, KEYS[:1], load=True)  # corrupt: its end waits for the quarantine
        assert moving.wait(10)
        submit(s, client, 3, KEYS[1:], load=True)  # the reactor goes on meanwhile
        assert not client.wait(3).failures and client.loaded[KEYS[1]] == payload(KEYS[1])
        assert 2 not in client.ends and path.exists()
    finally:
        gate.set()
    end = client.wait(2)
    assert end.failures[0].step is Step.CHECK and end.quarantine == (0,)
    assert not path.exists() and s.counters["quarantined"] == 1
    assert moved_on and moved_on[0].startswith(THREAD_PREFIX)
