"""The reactor over a medium of several devices (lanes), and payload checks on verifier threads."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import pykv.reactor.verify
from pykv.format import HEADER_SIZE, Geometry
from pykv.io.backend import OpKind
from pykv.io.probe import open_backend
from pykv.media import PosixMedium
from pykv.namespace import Namespace
from pykv.reactor import LoadBlock, Reactor, ReactorConfig, ReadyBlock, StoreBlock, backend_depth
from pykv.reactor.types import Awaiting
from pykv.reactor.verify import THREAD_PREFIX
from pykv.staging import StagingPool, slot_bytes_for
from pykv.tree import KVTree

GEOMETRY = Geometry(tokens=64, segments=4, segment_bytes=3000)
NS = Namespace("tiny", "bf16", "test", 64)


def pattern(index: int) -> bytes:
    return bytes((index * 5 + i) % 249 for i in range(GEOMETRY.payload_length))


class Client:
    """Fills stores with ``pattern(index)``; keeps delivered payloads by (job, index)."""

    def __init__(self) -> None:
        self.reactor: Reactor | None = None
        self.payloads: dict[tuple[object, int], bytes] = {}

    def fill(self, requests) -> None:
        for r in requests:
            self.reactor.pool.payload_view(r.slot, r.length)[:] = pattern(r.index)
            self.reactor.filled(r.transfer, True)

    def deliver(self, blocks: list[ReadyBlock]) -> None:
        for b in blocks:
            self.payloads[b.job, b.index] = bytes(self.reactor.pool.payload_view(b.slot, b.header.payload_length))
            self.reactor.consumed(b.transfer)


class TwoDevices(PosixMedium):
    """One tree, seen as two devices: the blocks in ``slow`` live on lane 1."""

    def __init__(self, tree: KVTree) -> None:
        super().__init__(tree)
        self.slow: set[Path] = set()

    @property
    def lanes(self) -> int:
        return 2

    def lane(self, location: Path) -> int:
        return 1 if location in self.slow else 0


class StalledReads:
    """A backend (wrapping a real one) on which the reads of some files never complete until ``release``."""

    def __init__(self, inner, stalled: set[bytes]) -> None:
        self.inner, self.stalled = inner, stalled
        self.paths: dict[int, bytes] = {}  # transfer -> the path its open named
        self.held: list = []
        self._flush = False

    def submit(self, requests) -> None:
        passed = []
        for r in requests:
            if r.op is OpKind.OPEN and r.token[0] is Awaiting.OPEN:
                self.paths[r.token[1]] = r.path
            stalled = r.op is OpKind.READ and self.paths.get(r.token[1]) in self.stalled and not self._flush
            (self.held if stalled else passed).append(r)
        if passed:
            self.inner.submit(passed)

    def wait(self, min_completions: int = 1, timeout: float | None = None):
        if self._flush and self.held:  # on the reactor's thread, like every other submit
            held, self.held = self.held, []
            self.inner.submit(held)
        return self.inner.wait(min_completions, 0.05 if self.held else timeout)

    @property
    def in_flight(self) -> int:
        return self.inner.in_flight + len(self.held)

    def release(self) -> None:
        self._flush = True
        self.inner.wake()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def store_blocks(tree: KVTree, first: int, count: int) -> list[StoreBlock]:
    out = []
    for i in range(first, first + count):
        key = i.to_bytes(4, "big") * 8
        out.append(StoreBlock(tree.block_path(NS.id, key), NS.fingerprint, key, GEOMETRY))
    return out


def as_loads(blocks: list[StoreBlock]) -> list[LoadBlock]:
    return [LoadBlock(b.path, b.namespace, b.key, b.geometry) for b in blocks]


def make_reactor(tree: KVTree, backend, medium, client: Client, *, slots: int = 6, **config) -> Reactor:
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), slots)
    reactor = client.reactor = Reactor(backend, pool, medium, config=ReactorConfig(**config), sink=client,
                                       source=client)
    return reactor


def close(reactor: Reactor) -> None:
    reactor.close()
    reactor.pool.close()


def verifier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


# -- lanes -------------------------------------------------------------------------------------------
def test_a_device_whose_reads_stall_does_not_starve_the_other_device(tmp_path):
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    slow, fast = store_blocks(tree, 0, 4), store_blocks(tree, 100, 6)
    medium = TwoDevices(tree)
    medium.slow = {b.path for b in slow}
    backend = StalledReads(open_backend("auto", depth=64), {os.fsencode(b.path) for b in slow})
    client = Client()
    reactor = make_reactor(tree, backend, medium, client, io_depth=2, open_ahead=2)
    try:
        reactor.write("s", slow + fast)
        assert reactor.wait_for("s", timeout=30).ok
        reactor.read("slow", as_loads(slow))  # lane 1: its reads never complete
        reactor.read("fast", as_loads(fast))  # lane 0, queued behind them
        fast_result = reactor.wait_for("fast", timeout=30)
        assert fast_result.ok and {i for job, i in client.payloads if job == "fast"} == set(range(6))
        assert len(backend.held) == 2  # lane 1 has io_depth reads out, no more
        backend.release()
        assert reactor.wait_for("slow", timeout=30).ok
        assert all(client.payloads["slow", i] == pattern(i) for i in range(4))
    finally:
        backend.release()
        close(reactor)


def test_the_backend_is_sized_for_every_lane(tmp_path):
    config = ReactorConfig(io_depth=4, open_ahead=8, read_segment=4096)
    slot = slot_bytes_for(GEOMETRY.payload_length)
    pieces = config.requests_per_read(slot)
    assert backend_depth(config, slot) == 2 * (4 * pieces + 8) + 8  # one lane: as before
    assert backend_depth(config, slot, lanes=3) == 2 * 3 * (4 * pieces + 8) + 8
    tree = KVTree.create(tmp_path / "tree")
    pool = StagingPool(slot, 2)
    try:
        small = open_backend("auto", depth=2 * (4 * pieces + 8) - 1)  # one short of two lanes' reads and opens
        with pytest.raises(ValueError, match="on each of 2 lanes; use backend_depth"):
            Reactor(small, pool, TwoDevices(tree), config=config)
        small.close()
        Reactor(open_backend("auto", depth=backend_depth(config, slot, lanes=2)), pool, TwoDevices(tree),
                config=config).close()
    finally:
        pool.close()


# -- payload checks on verifier threads ---------------------------------------------------------------
@pytest.fixture
def verify_rig(tmp_path):
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    client = Client()
    reactor = make_reactor(tree, open_backend("auto", depth=64), PosixMedium(tree), client, io_depth=1,
                           open_ahead=4, verify_threads=2)
    yield tree, reactor, client
    close(reactor)


def test_payload_checks_run_off_the_reactor_thread_and_a_corrupt_payload_is_still_refused(verify_rig, monkeypatch):
    tree, reactor, client = verify_rig
    checked_on: list[str] = []
    real = pykv.reactor.verify.verify_payload

    def recording(*args, **kwargs):
        checked_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(pykv.reactor.verify, "verify_payload", recording)
    blocks = store_blocks(tree, 0, 4)
    reactor.write("s", blocks)
    assert reactor.wait_for("s", timeout=30).ok
    with open(blocks[2].path, "r+b") as f:  # one payload bit flipped
        f.seek(HEADER_SIZE + 77)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 77)
        f.write(bytes([byte[0] ^ 4]))
    reactor.read("l", as_loads(blocks))
    result = reactor.wait_for("l", timeout=30)
    assert set(result.failed) == {2}
    assert result.failed[2].corrupt and "payload checksum mismatch" in str(result.failed[2])
    assert {i for _, i in client.payloads} == {0, 1, 3}
    assert len(checked_on) == 4 and all(name.startswith(THREAD_PREFIX) for name in checked_on)
    assert reactor.pool.ledger.free == reactor.pool.num_slots


def test_reads_go_on_while_a_block_is_being_verified(verify_rig, monkeypatch):
    """io_depth 1: with the first block's check held, the other blocks are still read and checked."""
    tree, reactor, client = verify_rig
    blocks = store_blocks(tree, 0, 4)
    reactor.write("s", blocks)
    assert reactor.wait_for("s", timeout=30).ok
    real = pykv.reactor.verify.verify_payload
    gate, others = threading.Event(), []

    def held_for_block_0(header, payload, *, path):
        if path == blocks[0].path:
            assert gate.wait(30)
        else:
            others.append(path)
        return real(header, payload, path=path)

    monkeypatch.setattr(pykv.reactor.verify, "verify_payload", held_for_block_0)
    reactor.read("first", as_loads(blocks[:1]))
    reactor.read("rest", as_loads(blocks[1:]))
    assert reactor.wait_for("rest", timeout=30).ok  # read with block 0 still verifying
    assert sorted(others) == sorted(b.path for b in blocks[1:])  # two verifier threads: any order
    gate.set()
    assert reactor.wait_for("first", timeout=30).ok
    assert client.payloads["first", 0] == pattern(0)


def test_stores_seal_on_the_verifier_threads_header_loads_start_none_and_close_stops_them(tmp_path):
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    before = set(verifier_threads())
    for verify in ("full", "header"):
        client = Client()
        reactor = make_reactor(tree, open_backend("auto", depth=64), PosixMedium(tree), client, verify=verify,
                               verify_threads=3)
        blocks = store_blocks(tree, 0 if verify == "full" else 5, 5)
        reactor.write("s", blocks)
        reactor.wait_for("s", timeout=30)
        started = set(verifier_threads()) - before
        assert 0 < len(started) <= 3  # the stores' checksums, off the reactor thread in both modes
        reactor.read("l", as_loads(blocks))
        assert reactor.wait_for("l", timeout=30).ok
        close(reactor)
        assert not set(verifier_threads()) - before
    client = Client()  # header mode, loads only: nothing to hash, no thread
    reactor = make_reactor(tree, open_backend("auto", depth=64), PosixMedium(tree), client, verify="header",
                           verify_threads=3)
    reactor.read("l", as_loads(store_blocks(tree, 0, 10)))
    assert reactor.wait_for("l", timeout=30).ok
    assert not set(verifier_threads()) - before
    close(reactor)


def test_a_stores_checksum_is_computed_on_a_verifier_thread_not_the_reactors(tmp_path, monkeypatch):
    import threading

    import pykv.reactor.verify as reactor_verify
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    sealed_on = []
    real = reactor_verify.seal_header

    def recording(block, head, payload, keys, codec):
        sealed_on.append(threading.current_thread().name)
        return real(block, head, payload, keys, codec)
    monkeypatch.setattr(reactor_verify, "seal_header", recording)
    reactor = make_reactor(tree, open_backend("auto", depth=64), PosixMedium(tree), Client(), verify="header",
                           verify_threads=2)
    blocks = store_blocks(tree, 0, 4)
    reactor.write("s", blocks)
    assert reactor.wait_for("s", timeout=30).ok
    close(reactor)
    assert len(sealed_on) == 4 and all(name.startswith(reactor_verify.THREAD_PREFIX) for name in sealed_on)
    assert all(tree.contains(NS.id, b.key) for b in blocks)


class RefusingMedium(PosixMedium):
    """A medium that refuses every store at once, before any I/O (a read-only file system)."""

    def prepare_write(self, path):
        raise OSError(30, "Read-only file system")


@pytest.mark.parametrize("engine", ["threadpool", "io_uring"])
def test_stores_refused_before_any_io_still_finish_their_job(tmp_path, engine, monkeypatch):
    """Nothing is in flight when the medium refuses the write: the reactor must still step the
    policy to the job's end instead of waiting for a completion that never comes (the sealing
    takes a while, so the reactor is asleep in the backend when it ends)."""
    import time

    real = pykv.reactor.verify.seal_header
    monkeypatch.setattr(pykv.reactor.verify, "seal_header",
                        lambda *args: (time.sleep(0.05), real(*args))[1])
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    try:
        backend = open_backend(engine, depth=64)
    except Exception as exc:  # noqa: BLE001 - io_uring refused here
        pytest.skip(f"{engine}: {exc}")
    reactor = make_reactor(tree, backend, RefusingMedium(tree), Client(), verify="header", verify_threads=2)
    try:
        for round_ in range(3):
            reactor.write(round_, store_blocks(tree, 10 * round_, 1))
            result = reactor.wait_for(round_, timeout=10)
            assert set(result.failed) == {0} and result.failed[0].medium_refuses_stores
    finally:
        close(reactor)
