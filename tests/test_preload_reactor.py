"""Preloads through the real reactor, real files and a real backend: claims, joins, sharing, waste.

A counting wrapper around the backend counts how often each block file is opened
for reading (one open per read of a file), so "no block read twice" is checked
where it happens.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pykv.format import Geometry
from pykv.io.backend import IoBackend, IoRequest, OpKind
from pykv.io.probe import open_backend
from pykv.media import PosixMedium
from pykv.namespace import Namespace
from pykv.reactor import FillRequest, LoadBlock, Reactor, ReactorConfig, ReadyBlock, StoreBlock
from pykv.reactor.types import Awaiting
from pykv.staging import StagingPool, slot_bytes_for
from pykv.tree import KVTree

GEOMETRY = Geometry(tokens=64, segments=2, segment_bytes=6000)
NS = Namespace("tiny", "bf16", "preload-test", 64)


def pattern(key: bytes) -> bytes:
    return bytes((key[0] * 13 + i) % 251 for i in range(GEOMETRY.payload_length))


class CountingBackend(IoBackend):
    """Delegates to a real backend; counts read-opens per path; can hold reads back."""

    name = "counting"

    def __init__(self, inner: IoBackend) -> None:
        super().__init__(inner.depth)
        self.inner = inner
        self.read_opens: Counter[bytes] = Counter()
        self.hold_reads = False
        self._held: list[IoRequest] = []
        self._flush = False

    def submit(self, requests):
        now = []
        for r in requests:
            if r.op is OpKind.OPEN and r.token[0] is Awaiting.OPEN:
                self.read_opens[r.path] += 1
            if r.op is OpKind.READ and self.hold_reads:
                self._held.append(r)
                continue
            now.append(r)
        if now:
            self.inner.submit(now)

    def wait(self, min_completions=1, timeout=None):
        if self._flush:  # on the reactor thread, like every other submit
            self._flush, held, self._held = False, self._held, []
            self.inner.submit(held)
        return self.inner.wait(min_completions, timeout)

    def release_reads(self) -> None:
        self.hold_reads = False
        self._flush = True
        self.inner.wake()

    def wake(self):
        self.inner.wake()

    @property
    def in_flight(self) -> int:
        return self.inner.in_flight + len(self._held)

    def close(self):
        self.inner.close()


class Sink:
    def __init__(self) -> None:
        self.reactor: Reactor | None = None
        self.payloads: dict[tuple[object, int], bytes] = {}
        self.slots: dict[tuple[object, int], int] = {}  # the slot each block was delivered from

    def deliver(self, blocks: list[ReadyBlock]) -> None:
        for b in blocks:
            self.slots[(b.job, b.index)] = b.slot
            self.payloads[(b.job, b.index)] = bytes(self.reactor.pool.payload_view(b.slot, b.header.payload_length))
            self.reactor.consumed(b.transfer)


class Source:
    def __init__(self) -> None:
        self.reactor: Reactor | None = None
        self.keys: dict[object, list[bytes]] = {}

    def fill(self, requests: list[FillRequest]) -> None:
        for r in requests:
            self.reactor.pool.payload_view(r.slot, r.length)[:] = pattern(self.keys[r.job][r.index])
            self.reactor.filled(r.transfer, True)


def key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
def rig(tmp_path):
    made = []

    def make(slots: int = 8, depth: int = 2, reserved: int = 0, max_speculative: int | None = None):
        tree = KVTree.create(tmp_path / "tree")
        tree.ensure_namespace(NS)
        pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), slots, reserved=reserved)
        backend = CountingBackend(open_backend("threadpool", depth=64))
        sink, source = Sink(), Source()
        reactor = Reactor(backend, pool, PosixMedium(tree), sink=sink, source=source,
                          config=ReactorConfig(io_depth=depth, open_ahead=4, max_speculative=max_speculative))
        sink.reactor = source.reactor = reactor
        made.append((reactor, pool))
        return tree, reactor, backend, sink, source
    yield make
    for reactor, pool in made:
        reactor.close()
        pool.close()


def load_blocks(tree: KVTree, keys: list[bytes], geometry: Geometry | None = GEOMETRY, **extra) -> list[LoadBlock]:
    return [LoadBlock(tree.block_path(NS.id, k), NS.fingerprint, k, geometry, **extra) for k in keys]


def store(tree, reactor, source, keys: list[bytes]) -> None:
    source.keys["store"] = keys
    reactor.write("store", [StoreBlock(tree.block_path(NS.id, k), NS.fingerprint, k, GEOMETRY)
                                   for k in keys])
    assert reactor.wait_for("store", timeout=30).ok


def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_load_claims_ready_preloads_and_reads_nothing(rig):
    tree, reactor, backend, sink, source = rig()
    keys = [key(i) for i in range(3)]
    store(tree, reactor, source, keys)
    reactor.read_ahead("A", load_blocks(tree, keys, geometry=None))
    until(lambda: reactor.stats["preloads_started"] == 3 and reactor.policy.speculative_slots == 3)
    opens_before = sum(backend.read_opens.values())
    reactor.read("job", load_blocks(tree, keys), owner="A")
    result = reactor.wait_for("job", timeout=30)
    assert result.ok and result.bytes > 0
    assert [sink.payloads[("job", i)] for i in range(3)] == [pattern(k) for k in keys]
    assert sum(backend.read_opens.values()) == opens_before == 3
    assert reactor.stats["preloads_claimed"] == 3 and reactor.stats["preload_wasted_bytes"] == 0
    until(lambda: reactor.pool.ledger.free == 8)  # A claimed everything: nothing stays staged


def test_a_load_joins_a_preload_whose_read_is_in_flight(rig):
    tree, reactor, backend, sink, source = rig()
    store(tree, reactor, source, [key(1)])
    backend.hold_reads = True
    reactor.read_ahead("A", load_blocks(tree, [key(1)], geometry=None))
    until(lambda: reactor.stats["preloads_started"] == 1)
    reactor.read("job", load_blocks(tree, [key(1)]), owner="A")
    until(lambda: reactor.stats["preloads_joined"] == 1)
    backend.release_reads()
    assert reactor.wait_for("job", timeout=30).ok
    assert sink.payloads[("job", 0)] == pattern(key(1))
    assert sum(backend.read_opens.values()) == 1  # one open, one read: the preload's


def test_waiting_requests_sharing_a_prefix_share_one_read_per_block(rig):
    tree, reactor, backend, sink, source = rig()
    keys = [key(i) for i in range(4)]
    store(tree, reactor, source, keys)
    for owner in ("A", "B", "C"):
        reactor.read_ahead(owner, load_blocks(tree, keys[:3], geometry=None))  # the shared prefix
    until(lambda: reactor.policy.speculative_slots == 3)
    assert reactor.stats["preloads_submitted"] == 3
    for owner in ("A", "B", "C"):
        reactor.read(owner, load_blocks(tree, keys), owner=owner)  # prefix + one own block
        assert reactor.wait_for(owner, timeout=30).ok
        assert [sink.payloads[(owner, i)] for i in range(4)] == [pattern(k) for k in keys]
    opens = {path.rsplit(b"/", 1)[1]: n for path, n in backend.read_opens.items()}
    prefix = {bytes(tree.block_path(NS.id, k).name, "ascii") for k in keys[:3]}
    assert {name: n for name, n in opens.items() if name in prefix} == dict.fromkeys(prefix, 1)
    assert sum(opens.values()) == 3 + 3  # block 3 was never preloaded: each request reads it
    assert reactor.stats["preloads_claimed"] == 9 and reactor.stats["preload_wasted_bytes"] == 0
    until(lambda: reactor.pool.ledger.free == 8)


def test_release_frees_unclaimed_preloads_and_counts_the_waste(rig):
    tree, reactor, backend, sink, source = rig()
    keys = [key(i) for i in range(2)]
    store(tree, reactor, source, keys)
    reactor.read_ahead("A", load_blocks(tree, keys, geometry=None))
    reactor.read_ahead("B", load_blocks(tree, keys[:1], geometry=None))
    until(lambda: reactor.policy.speculative_slots == 2)
    reactor.release_preloads("A")  # B still wants block 0
    until(lambda: reactor.policy.speculative_slots == 1)
    file_size = tree.block_path(NS.id, keys[1]).stat().st_size
    assert reactor.stats["preload_wasted_bytes"] == file_size
    reactor.release_preloads("B")  # e.g. B was aborted while waiting
    until(lambda: reactor.pool.ledger.free == 8)
    assert reactor.stats["preload_wasted_bytes"] == 2 * file_size


def test_demand_reclaims_preload_slots_and_speculation_stays_within_its_bound(rig):
    tree, reactor, backend, sink, source = rig(slots=5, depth=1, max_speculative=3)
    keys = [key(i) for i in range(10)]
    store(tree, reactor, source, keys)
    reactor.read_ahead("W", load_blocks(tree, keys[:6], geometry=None))
    until(lambda: reactor.policy.speculative_slots == 3)
    time.sleep(0.1)
    assert reactor.policy.speculative_slots == 3  # max_speculative: no fourth
    reactor.read("demand", load_blocks(tree, keys[6:]))  # 4 blocks through 2 free slots
    assert reactor.wait_for("demand", timeout=30).ok
    assert reactor.stats["preload_slots_high"] <= 3 and reactor.stats["slots_high"] <= 5


def test_a_dram_tier_load_claims_the_preload_and_copies_it_and_preloads_never_use_dram_slots(rig):
    tree, reactor, backend, sink, source = rig(slots=6, reserved=2)
    store(tree, reactor, source, [key(1)])
    with pytest.raises(ValueError):
        reactor.read_ahead("A", load_blocks(tree, [key(1)], geometry=None, slot=5))
    reactor.read_ahead("A", load_blocks(tree, [key(1)], geometry=None))
    until(lambda: reactor.policy.speculative_slots == 1)
    reads = reactor.stats["disk_reads"]
    reactor.read("promote", load_blocks(tree, [key(1)], slot=5), owner="B")  # promotion into DRAM slot 5
    assert reactor.wait_for("promote", timeout=30).ok
    assert reactor.stats["preloads_claimed"] == 1 and reactor.stats["disk_reads"] == reads  # no second read
    assert bytes(reactor.pool.payload_view(5, GEOMETRY.payload_length)) == pattern(key(1))
    assert sink.slots[("promote", 0)] == 5  # the copier reads the DRAM slot, not the preload's
    assert sink.payloads[("promote", 0)] == pattern(key(1))
    reactor.release_preloads("A")
    until(lambda: reactor.policy.speculative_slots == 0)  # the preload's staging slot is free again
    until(lambda: reactor.pool.ledger.free == 4)
