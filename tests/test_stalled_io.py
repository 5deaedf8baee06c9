"""A stalled mount under the worker's BlockStore: every load or store without progress for
``io_deadline`` is given up, and what a stalled read or write does when it wakes never reaches
the engine's memory (``pykv.stall``).

The stall is the thread-pool backend's syscalls blocking on an event (reads, writes or both),
as a hung NFS server or a stopped FUSE daemon blocks them; the FUSE version through the real
connector is ``test_stalled_mount_e2e.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
from test_store import KEYS, NS, Client, payload, store, submit  # noqa: F401 (store: the fixture)

from pykv.blockfile import check_block
from pykv.failures import Step
from pykv.io import threadpool
from pykv.io.backend import OpKind
from pykv.store import BlockStore
from pykv.tree import is_temp_name

DEADLINE = 0.5


class Stall:
    """Blocks the thread pool's reads and/or writes while ``on``."""

    def __init__(self, monkeypatch, ops: tuple[OpKind, ...]) -> None:
        self.ops, self.gate, self.blocked = ops, threading.Event(), 0
        self.gate.set()
        execute = threadpool._execute

        def gated(request):
            if request.op in self.ops and not self.gate.is_set():
                self.blocked += 1
                self.gate.wait(60)
            return execute(request)
        monkeypatch.setattr(threadpool, "_execute", gated)

    def on(self) -> None:
        self.gate.clear()

    def off(self) -> None:
        self.gate.set()


class CountingClient(Client):
    """Counts the copies into and out of the slots, by key."""

    def __init__(self) -> None:
        super().__init__()
        self.copied_out: list[bytes] = []
        self.copied_in: list[bytes] = []

    def from_slots(self, copies, done):
        self.copied_out += [self.jobs[c.job][c.index] for c in copies]
        super().from_slots(copies, done)

    def to_slots(self, copies, done):
        self.copied_in += [self.jobs[c.job][c.index] for c in copies]
        super().to_slots(copies, done)


@pytest.fixture
def make_store(store):  # noqa: F811 (test_store's fixture)
    """``test_store``'s store with the counting client, a short io_deadline and a shallow depth."""
    def make(transient: int = 4) -> tuple[BlockStore, CountingClient]:
        return store(transient=transient, early_release=True, client_type=CountingClient, io_deadline=DEADLINE,
                     io_depth=2, open_ahead=2)
    return make


def poll_until_ended(block_store: BlockStore, client: Client, job, limit: float) -> float:
    """Call ``check_stalls`` as the worker's ``get_finished`` does until ``job`` ends; its wall time."""
    began = time.monotonic()
    while job not in client.ends and not any(r.job == job for r in client.released):
        assert time.monotonic() - began < limit, f"job {job} did not end within {limit} s"
        block_store.check_stalls()
        time.sleep(0.01)
    return time.monotonic() - began


def test_a_stalled_load_is_given_up_after_the_deadline_and_its_late_reads_never_reach_the_engine(make_store,
                                                                                                 monkeypatch):
    s, client = make_store()
    submit(s, client, "stored", KEYS, load=False)
    assert not client.wait("stored").failures
    stall = Stall(monkeypatch, (OpKind.READ,))
    stall.on()
    submit(s, client, "load", KEYS, load=True)
    took = poll_until_ended(s, client, "load", limit=10)
    assert DEADLINE * 0.9 <= took < DEADLINE + 1.0
    end = client.ends["load"]
    assert sorted(end.failures) == [0, 1, 2] and all(f.step is Step.STALL for f in end.failures.values())
    assert end.first_failed == 0 and s.counters["load_jobs_given_up"] == 1
    assert client.copied_out == [] and stall.blocked >= 1
    stall.off()  # the mount wakes: the reads complete, and go nowhere
    deadline = time.monotonic() + 10
    while s.stalls.watched and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.stalls.watched == 0  # the reactor's own end of the job arrived and was dropped
    assert client.copied_out == [] and list(client.ends) == ["stored", "load"]
    assert s.pool.ledger.free == s.pool.ledger.num_slots - s.pool.ledger.reserved  # every slot came back
    submit(s, client, "again", KEYS, load=True)  # the store serves again
    assert not client.wait("again").failures and client.loaded == {k: payload(k) for k in KEYS}


def test_blocks_copied_before_the_stall_stay_loaded_and_only_the_rest_is_recomputed(make_store, monkeypatch):
    s, client = make_store(transient=8)
    keys = [bytes([9, i]) * 16 for i in range(6)]
    submit(s, client, "stored", keys, load=False)
    assert not client.wait("stored").failures
    stall = Stall(monkeypatch, (OpKind.READ,))
    reads = [0]
    execute = threadpool._execute

    def after_two(request):  # the first two block reads go through, then the mount stalls
        if request.op is OpKind.READ:
            reads[0] += 1
            if reads[0] > 2:
                stall.on()
        return execute(request)
    monkeypatch.setattr(threadpool, "_execute", after_two)
    submit(s, client, "load", keys, load=True)
    poll_until_ended(s, client, "load", limit=10)
    end = client.ends["load"]
    copied = {keys.index(k) for k in client.copied_out}
    assert copied and set(end.failures) == set(range(6)) - copied
    assert all(client.loaded[keys[i]] == payload(keys[i]) for i in copied)
    stall.off()


def test_a_store_whose_writes_stall_ends_for_the_engine_and_publishes_whole_files_when_the_mount_wakes(
        make_store, monkeypatch, tmp_path):
    s, client = make_store()
    stall = Stall(monkeypatch, (OpKind.WRITE,))
    stall.on()
    submit(s, client, "store", KEYS, load=False)
    took = poll_until_ended(s, client, "store", limit=10)
    assert took < DEADLINE + 1.0
    [release] = [r for r in client.released if r.job == "store"]
    assert release.unstored == () and s.counters["store_jobs_given_up"] == 1  # every block was in its slot
    assert "store" not in client.ends  # the writes still run
    stall.off()
    end = client.wait("store")
    assert end.released and not end.failures
    for key in KEYS:
        check_block(s.devices[0].block_path(NS.id, key))  # whole, valid files
    assert not [p for p in (tmp_path / "tree").rglob("*") if is_temp_name(p.name)]


def test_store_blocks_still_waiting_for_a_slot_are_never_filled_after_the_give_up(make_store, monkeypatch,
                                                                                   tmp_path):
    s, client = make_store(transient=2)
    stall = Stall(monkeypatch, (OpKind.WRITE,))
    stall.on()
    keys = [bytes([5, i]) * 16 for i in range(6)]  # two slots: four blocks wait behind two stalled writes
    submit(s, client, "store", keys, load=False)
    poll_until_ended(s, client, "store", limit=10)
    [release] = [r for r in client.released if r.job == "store"]
    filled = set(client.copied_in)
    assert len(filled) == 2 and set(release.unstored) == set(keys) - filled
    stall.off()
    end = client.wait("store")
    assert set(client.copied_in) == filled  # no fill after the engine got its blocks back
    assert {end.keys[i] for i, _ in end.failed_stores}.isdisjoint(release.unstored)  # named once
    for key in keys:
        path = s.devices[0].block_path(NS.id, key)
        assert path.exists() == (key in filled)
        if key in filled:
            check_block(path)
    assert not [p for p in (tmp_path / "tree").rglob("*") if is_temp_name(p.name)]


def test_waiting_for_a_stalled_stores_blocks_takes_at_most_the_deadline(make_store, monkeypatch):
    s, client = make_store(transient=2)
    stall = Stall(monkeypatch, (OpKind.WRITE,))
    stall.on()
    keys = [bytes([6, i]) * 16 for i in range(6)]
    submit(s, client, "store", keys, load=False)
    began = time.monotonic()
    s.wait_engine_blocks(["store"])  # vLLM wants the GPU blocks back
    assert time.monotonic() - began < DEADLINE + 1.5
    stall.off()


def test_shutdown_with_io_that_never_returns_ends_within_the_deadline_and_keeps_the_memory(make_store,
                                                                                           monkeypatch):
    s, client = make_store()
    submit(s, client, "stored", KEYS, load=False)
    client.wait("stored")
    stall = Stall(monkeypatch, (OpKind.READ,))
    stall.on()
    submit(s, client, "load", KEYS, load=True)
    time.sleep(0.1)
    began = time.monotonic()
    s.close()
    assert time.monotonic() - began < DEADLINE + 1.0
    assert s.io_stopped is False
    s.pool.view(0)[:8] = bytes(8)  # the staging memory is still mapped: a late read may land in it
    stall.off()
