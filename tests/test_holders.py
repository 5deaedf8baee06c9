"""``BlockHolders`` under the worker's ``BlockStore``: over several devices a job's existence checks
run on the devices' threads within ``lookup_deadline``, never on the thread that submits the job
(vLLM's model runner). One device's ``lstat`` blocks as on a stalled mount (NFS, a stopped FUSE
daemon): a load or store still returns within about the deadline, the other devices' blocks load
and store, the stalled device's are recomputed or left unstored, and nothing hangs at close.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from test_store import GEOMETRY, NS, Client, payload, submit

from pykv.config import PykvConfig
from pykv.failures import Step
from pykv.holders import MISSING, UNANSWERED
from pykv.staging import slot_bytes_for
from pykv.store import BlockStore, EngineShape

DEADLINE = 0.2
KEYS = [bytes([5, i]) * 16 for i in range(24)]


class Lstats:
    """``os.lstat`` under the devices' roots: the threads that called it, the calls made on the thread
    submitting a job (``submit``), and a gate that holds the calls under the stalled root while closed
    (set at teardown, so no thread stays blocked)."""

    def __init__(self, monkeypatch, roots: list[str]) -> None:
        self.roots, self.stalled, self.gate = roots, None, threading.Event()
        self.threads: set[str] = set()
        self.submitter: int | None = None
        self.on_submitter = self.held = 0
        real = os.lstat

        def lstat(path, *args, **kwargs):
            text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
            if any(text.startswith(root) for root in self.roots):
                self.threads.add(threading.current_thread().name)
                self.on_submitter += threading.get_ident() == self.submitter
                if self.stalled is not None and text.startswith(self.stalled) and not self.gate.is_set():
                    self.held += 1
                    self.gate.wait(30)
            return real(path, *args, **kwargs)
        monkeypatch.setattr(os, "lstat", lstat)

    def stall(self, root: str) -> None:
        self.stalled = os.path.join(root, "")
        self.gate.clear()

    def submit(self, call) -> float:
        """``call()`` as the submitting thread; its wall time."""
        self.submitter, began = threading.get_ident(), time.monotonic()
        try:
            call()
        finally:
            self.submitter = None
        return time.monotonic() - began


@pytest.fixture
def striped(tmp_path, monkeypatch):
    """A BlockStore over ``devices`` roots with a short lookup_deadline, and the lstat watch."""
    made, watches = [], []

    def make(devices: int) -> tuple[BlockStore, Client, Lstats]:
        roots = [tmp_path / f"dev{i}" for i in range(devices)]
        for root in roots:
            root.mkdir()
        watch = Lstats(monkeypatch, [os.path.join(str(root), "") for root in roots])
        watches.append(watch)
        config = PykvConfig.from_extra_config({"roots": [str(r) for r in roots], "io_engine": "threadpool",
                                               "lookup_deadline": f"{DEADLINE}s", "store_retry_interval": "60s"})
        client = Client()
        client.store = BlockStore(config, EngineShape(NS, slot_bytes_for(GEOMETRY.payload_length), 8, 0, 0, False),
                                  client)
        made.append(client.store)
        return client.store, client, watch
    yield make
    for watch in watches:
        watch.gate.set()
    for s in made:
        s.close()


def holder(s: BlockStore, key: bytes) -> int | None:
    return s.devices.holding(NS.id, key)


def test_a_healthy_set_round_trips_with_every_check_on_a_device_thread(striped):
    s, client, watch = striped(3)
    assert watch.submit(lambda: s.medium.locate(NS.id, KEYS[0])) >= 0 and watch.on_submitter  # the watch sees it
    watch.on_submitter = 0
    assert watch.submit(lambda: submit(s, client, "stored", KEYS, load=False)) < 5
    assert not client.wait("stored").failures
    assert all(holder(s, key) is not None for key in KEYS)
    watch.submit(lambda: submit(s, client, "load", KEYS, load=True))
    assert not client.wait("load").failures and client.loaded == {k: payload(k) for k in KEYS}
    assert any(name.startswith("pykv-lookup") for name in watch.threads)
    missing = [bytes([6, i]) * 16 for i in range(2)]
    watch.submit(lambda: submit(s, client, "missing", KEYS[:2] + missing, load=True))  # on no device: a miss
    end = client.wait("missing")
    assert end.failures == {2: MISSING, 3: MISSING} and end.first_failed == 2
    assert s.counters["blocks_unanswered"] == 0 and watch.on_submitter == 0


def test_a_stalled_device_costs_a_load_the_deadline_once_and_only_its_blocks_are_recomputed(striped):
    s, client, watch = striped(2)
    submit(s, client, "stored", KEYS, load=False)
    assert not client.wait("stored").failures
    on = {device: [k for k in KEYS if holder(s, k) == device] for device in (0, 1)}
    assert len(on[0]) >= 4 and len(on[1]) >= 1
    watch.stall(str(s.devices[1].root))
    client.loaded.clear()
    assert watch.submit(lambda: submit(s, client, "healthy", on[0], load=True)) < DEADLINE + 0.5
    assert not client.wait("healthy").failures and client.loaded == {k: payload(k) for k in on[0]}
    mixed = on[0][:2] + on[1][:1] + on[0][2:4]
    assert watch.submit(lambda: submit(s, client, "mixed", mixed, load=True)) < DEADLINE + 0.5  # stalled: at once
    end = client.wait("mixed")
    assert end.failures == {2: UNANSWERED, 3: UNANSWERED, 4: UNANSWERED} and end.failures[2].step is Step.STALL
    assert end.quarantine == () and s.counters["quarantined"] == 0 and not s.pause.active(time.monotonic())
    assert s.counters["blocks_unanswered"] == 3 and s.counters["load_blocks_failed_disk"] == 3
    assert watch.held >= 1 and watch.on_submitter == 0
    assert watch.submit(lambda: s.preload_blocks("req", on[1][:1] + on[0][:1])) < DEADLINE + 0.5
    assert watch.submit(s.close) < 1.0  # a check still hangs on its daemon thread: close does not wait for it
    watch.gate.set()


def test_a_stalled_device_leaves_its_blocks_unstored_and_the_others_are_written(striped):
    s, client, watch = striped(4)
    stalled = 2
    watch.stall(str(s.devices[stalled].root))
    assert watch.submit(lambda: submit(s, client, "store", KEYS, load=False)) < DEADLINE + 0.5
    end = client.wait("store")
    unknown = {i for i, key in enumerate(KEYS) if stalled in s.devices.candidates(key)}
    assert 0 < len(unknown) < len(KEYS)
    assert end.failures == {i: UNANSWERED for i in unknown}
    assert sorted(end.failed_stores) == [(i, False) for i in sorted(unknown)] and end.pause is None
    assert s.counters["blocks_unanswered"] == len(unknown) and s.counters["store_blocks_failed"] == len(unknown)
    assert s.counters["store_published"] == len(KEYS) - len(unknown) and not s.pause.active(time.monotonic())
    watch.gate.set()  # the mount wakes: the written blocks are where a lookup finds them, the others nowhere
    for i, key in enumerate(KEYS):
        assert (holder(s, key) is None) == (i in unknown)
    assert watch.on_submitter == 0


def test_a_store_whose_every_block_is_unknown_ends_at_once_with_none_written(striped):
    s, client, watch = striped(2)
    watch.stall(str(s.devices[0].root))
    assert watch.submit(lambda: submit(s, client, "store", KEYS[:4], load=False)) < DEADLINE + 0.5
    end = client.wait("store")
    assert end.failures == {i: UNANSWERED for i in range(4)} and s.counters["store_published"] == 0
    s.wait_engine_blocks(["store"])  # the engine's blocks were never copied: nothing to wait for


def test_one_device_makes_no_existence_check_and_starts_no_lookup_thread(tmp_path, monkeypatch):
    (tmp_path / "tree").mkdir()
    watch = Lstats(monkeypatch, [os.path.join(str(tmp_path / "tree"), "")])
    config = PykvConfig.from_extra_config({"root": str(tmp_path / "tree"), "io_engine": "threadpool"})
    client = Client()
    client.store = s = BlockStore(config, EngineShape(NS, slot_bytes_for(GEOMETRY.payload_length), 4, 0, 0, False),
                                  client)
    try:
        assert s.holders.calls is None
        watch.submit(lambda: submit(s, client, "stored", KEYS[:3], load=False))
        assert not client.wait("stored").failures
        watch.submit(lambda: submit(s, client, "load", KEYS[:3] + [b"\x01" * 32], load=True))
        end = client.wait("load")
        assert list(end.failures) == [3] and end.failures[3].step is Step.OPEN  # the open of a missing file
        assert not any(name.startswith("pykv-lookup") for name in watch.threads) and watch.on_submitter == 0
    finally:
        s.close()


def test_the_striped_medium_places_and_locates_from_found_holders_without_a_check(striped):
    s, _, watch = striped(4)
    keys = KEYS[:8]
    held = [s.devices.candidates(key)[2] if i % 2 else None for i, key in enumerate(keys)]
    paths, located = [], []
    watch.submit(lambda: paths.extend(s.medium.place_held(NS.id, keys, held)))
    watch.submit(lambda: located.extend(s.medium.locate_on(s.devices.candidates(k)[1], NS.id, k) for k in keys))
    assert watch.on_submitter == 0 and len(paths) == len(located) == len(keys)
    for key, device, path, on_second in zip(keys, held, paths, located):
        lane = s.medium.lane(path)
        assert lane in s.devices.candidates(key) and (device is None or lane == device)
        assert s.medium.lane(on_second) == s.devices.candidates(key)[1] and on_second.name == path.name
