"""BlockStore on a real tree with a client that copies bytes (no vLLM, no torch): the routes of
a job and where each failure goes (corrupt file -> quarantine, refused store -> pause)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pykv.config import PykvConfig
from pykv.failures import Step
from pykv.format import HEADER_SIZE, Geometry
from pykv.jobledger import JobEnd, Kind, Release
from pykv.namespace import Namespace
from pykv.staging import slot_bytes_for
from pykv.store import BlockRef, BlockStore, EngineShape

GEOMETRY = Geometry(tokens=64, segments=2, segment_bytes=4096)
NS = Namespace("tiny", "bf16", "test", 64)
KEYS = [bytes([7, i]) * 16 for i in range(3)]


def payload(key: bytes) -> bytes:
    return (key * (GEOMETRY.payload_length // len(key) + 1))[:GEOMETRY.payload_length]


class Client:
    """Copies payloads between a dict of blocks and the slots; collects every job's end."""

    def __init__(self) -> None:
        self.store: BlockStore | None = None
        self.loaded: dict[bytes, bytes] = {}
        self.ends: dict[object, JobEnd] = {}
        self.released: list[Release] = []
        self.jobs: dict[object, list[bytes]] = {}
        self.done = threading.Condition()

    def to_slots(self, copies, done):
        for c in copies:
            key = self.jobs[c.job][c.index]
            self.store.pool.view(c.slot)[HEADER_SIZE:HEADER_SIZE + c.length] = payload(key)
            done(c, True)

    def from_slots(self, copies, done):
        for c in copies:
            self.loaded[self.jobs[c.job][c.index]] = bytes(self.store.pool.view(c.slot)[HEADER_SIZE:HEADER_SIZE + c.length])
            done(c, True)

    def job_ended(self, end: JobEnd) -> None:
        with self.done:
            self.ends[end.job] = end
            self.done.notify_all()

    def store_released(self, release: Release) -> None:
        self.released.append(release)

    def wait(self, job) -> JobEnd:
        with self.done:
            assert self.done.wait_for(lambda: job in self.ends, timeout=20), f"job {job} did not end"
            return self.ends[job]


@pytest.fixture
def store(tmp_path):
    made = []

    def make(dram_slots: int = 0, early_release: bool = False, client_type: type[Client] = Client,
             transient: int = 4, **extra) -> tuple[BlockStore, Client]:
        (tmp_path / "tree").mkdir(exist_ok=True)  # as `pykv init` makes it: engines never create a root
        config = PykvConfig.from_extra_config({"root": str(tmp_path / "tree"), "io_engine": "threadpool",
                                               "store_retry_interval": "60s", **extra})
        client = client_type()
        shape = EngineShape(NS, slot_bytes_for(GEOMETRY.payload_length), transient, dram_slots, 0, early_release)
        client.store = BlockStore(config, shape, client)
        made.append(client.store)
        return client.store, client
    yield make
    for s in made:
        s.close()


def submit(store: BlockStore, client: Client, job, keys, *, load: bool, dram=None, resident=False):
    client.jobs[job] = list(keys)
    refs = [BlockRef(k, GEOMETRY, None if dram is None else dram[i], resident) for i, k in enumerate(keys)]
    if load:
        store.load_blocks(job, refs)
        return True
    return store.store_blocks(job, refs)


def test_a_store_then_a_load_round_trip_through_the_medium(store):
    s, client = store()
    submit(s, client, 1, KEYS, load=False)
    end = client.wait(1)
    assert end.kind is Kind.STORE and not end.failures and s.counters["store_published"] == 3
    submit(s, client, 2, KEYS, load=True)
    end = client.wait(2)
    assert not end.failures and client.loaded == {k: payload(k) for k in KEYS}
    assert s.stats()["load_blocks_disk"] == 3 and s.open_jobs == 0


def test_dram_blocks_are_served_from_their_slots_and_released_early(store):
    s, client = store(dram_slots=4, early_release=True)
    submit(s, client, 1, KEYS, load=False, dram=[0, 1, 2])
    end = client.wait(1)
    assert [r.job for r in client.released] == [1] and end.released and end.stores_ended == (0, 1, 2)
    for k in KEYS:
        os.unlink(s.devices[0].block_path(NS.id, k))  # only the DRAM tier can serve now
    submit(s, client, 2, KEYS[:2], load=True, dram=[0, 1], resident=True)
    assert not client.wait(2).failures and client.loaded == {k: payload(k) for k in KEYS[:2]}
    assert s.stats()["dram_delivered_blocks"] == 2 and s.reactor.stats["disk_reads"] == 0


def test_a_corrupt_file_is_quarantined_and_a_missing_one_is_not(store):
    s, client = store()
    submit(s, client, 1, KEYS[:2], load=False)
    client.wait(1)
    path = s.devices[0].block_path(NS.id, KEYS[0])
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 5)
        f.write(b"\x00\xff")
    os.unlink(s.devices[0].block_path(NS.id, KEYS[1]))
    submit(s, client, 2, KEYS[:2], load=True)
    end = client.wait(2)
    assert end.failures[0].step is Step.CHECK and end.failures[1].step is Step.OPEN
    assert end.quarantine == (0,) and not path.exists() and s.counters["quarantined"] == 1


def test_a_store_the_medium_refuses_pauses_stores(store, tmp_path):
    s, client = store()
    shard = s.devices[0].block_path(NS.id, KEYS[0]).parent.parent
    shard.parent.mkdir(parents=True, exist_ok=True)
    shard.write_text("not a directory")  # the block's directory cannot be made
    submit(s, client, 1, KEYS[:1], load=False)
    end = client.wait(1)
    assert end.pause is not None and end.pause.step is Step.MKDIR and s.counters["store_pauses"] == 1
    assert submit(s, client, 2, KEYS[1:2], load=False) is False  # paused: nothing submitted
    assert s.counters["store_blocks_paused"] == 1 and 2 not in client.ends


class HeldFills(Client):
    """Takes fill requests and copies them only when ``release`` is called (a slow GPU copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list = []
        self.fills_asked = threading.Event()

    def to_slots(self, copies, done):
        self.held.extend((c, done) for c in copies)
        self.fills_asked.set()

    def release(self) -> None:
        held, self.held = self.held, []
        for copy, done in held:
            super().to_slots([copy], done)


def test_a_store_without_a_free_slot_is_shed_when_vllm_needs_its_blocks_back(store):
    # 4 staging slots, 8 blocks: 4 are being copied in, 4 wait for a slot. vLLM's ``wait`` (it is
    # about to reuse the GPU blocks) must not wait for the disk to free slots: the 4 waiting blocks
    # are dropped, and ``wait`` ends as soon as the 4 copies under way are done.
    s, client = store(client_type=HeldFills)
    keys = [bytes([9, i]) * 16 for i in range(8)]
    submit(s, client, 1, keys, load=False)
    assert client.fills_asked.wait(10)
    waited = threading.Thread(target=s.wait_engine_blocks, args=([1],))
    waited.start()
    waited.join(0.5)
    assert waited.is_alive()  # the copies under way still hold the engine's blocks
    client.release()
    waited.join(10)
    assert not waited.is_alive()
    end = client.wait(1)
    assert sorted(end.failures) == [4, 5, 6, 7] and {f.step for f in end.failures.values()} == {Step.SHED}
    assert s.counters["store_blocks_shed"] == 4 and s.counters["store_published"] == 4
    assert not end.failed_stores or not any(in_dram for _, in_dram in end.failed_stores)
    submit(s, client, 2, keys, load=True)
    failures = client.wait(2).failures
    assert sorted(failures) == [4, 5, 6, 7] and client.loaded == {k: payload(k) for k in keys[:4]}


def test_a_store_that_can_have_slots_is_not_shed_however_soon_vllm_waits(store):
    s, client = store()
    submit(s, client, 1, KEYS, load=False)
    s.wait_engine_blocks([1])  # at once: the store's command may not have run yet
    assert not client.wait(1).failures and s.counters["store_blocks_shed"] == 0
    assert s.counters["store_published"] == 3


def test_a_store_through_dram_slots_is_filled_and_not_shed_while_staging_is_exhausted(store):
    s, client = store(dram_slots=2, client_type=HeldFills)
    first, second = [bytes([11, i]) * 16 for i in range(8)], [bytes([12, i]) * 16 for i in range(2)]
    submit(s, client, 1, first, load=False)  # 4 staging slots: 4 blocks copied in, 4 wait for a slot
    submit(s, client, 2, second, load=False, dram=[0, 1])
    deadline = time.monotonic() + 10
    while len(client.held) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(client.held) == 6  # the DRAM-slot store's copies started although staging was full
    client.release()
    s.wait_engine_blocks([2])
    assert not client.wait(2).failures and s.counters["store_blocks_shed"] == 0


def test_the_staging_gauges_give_the_pool_and_its_huge_pages(store, monkeypatch):
    from pykv.staging import StagingPool
    monkeypatch.setattr(StagingPool, "huge_bytes", lambda pool: pool.total_bytes // 2)
    s, _ = store()
    stats = s.stats()
    assert stats["staging_bytes"] == s.pool.total_bytes > 0
    assert stats["staging_huge_bytes"] == s.pool.total_bytes // 2
    monkeypatch.setattr(StagingPool, "huge_bytes", lambda pool: None)  # smaps unreadable: 0, not a failure
    assert store()[0].stats()["staging_huge_bytes"] == 0
