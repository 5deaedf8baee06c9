"""The reactor moving real blocks through real files with both I/O backends."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from pykv.blockfile import check_block
from pykv.failures import BlockFailure, Step
from pykv.format import HEADER_SIZE, Geometry
from pykv.io.probe import open_backend
from pykv.media import PosixMedium
from pykv.namespace import Namespace
from pykv.reactor import FillRequest, LoadBlock, Reactor, ReactorConfig, ReadyBlock, StoreBlock
from pykv.staging import StagingPool, slot_bytes_for
from pykv.tree import KVTree, is_temp_name

GEOMETRY = Geometry(tokens=64, segments=4, segment_bytes=3000)  # 12,000 bytes: not 4 KiB aligned
NS = Namespace("tiny", "bf16", "test", 64)


def pattern(index: int) -> bytes:
    return bytes((index * 7 + i) % 251 for i in range(GEOMETRY.payload_length))


class PatternSource:
    """Fills each store slot with ``pattern(index)``."""

    def __init__(self) -> None:
        self.reactor: Reactor | None = None

    def fill(self, requests: list[FillRequest]) -> None:
        for r in requests:
            self.reactor.pool.payload_view(r.slot, r.length)[:] = pattern(r.index)
            self.reactor.filled(r.transfer, True)


class CopySink:
    """Copies each delivered payload out, records batch sizes, frees the slot."""

    def __init__(self) -> None:
        self.reactor: Reactor | None = None
        self.payloads: dict[int, bytes] = {}
        self.batches: list[int] = []
        self.max_held = 0

    def deliver(self, blocks: list[ReadyBlock]) -> None:
        self.batches.append(len(blocks))
        pool = self.reactor.pool
        self.max_held = max(self.max_held, pool.num_slots - pool.ledger.free)
        for b in blocks:
            self.payloads[b.index] = bytes(pool.payload_view(b.slot, b.header.payload_length))
            self.reactor.consumed(b.transfer)


@pytest.fixture(params=[("io_uring", 0), ("threadpool", 0), ("io_uring", 4096), ("threadpool", 8192)],
                ids=["io_uring", "threadpool", "io_uring-segments", "threadpool-segments"])
def rig(request, tmp_path):
    """A reactor over a 3-slot pool; the ``-segments`` variants split each block read into pieces."""
    engine, segment = request.param
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 3)
    source, sink = PatternSource(), CopySink()
    backend = open_backend(engine, depth=64)
    assert backend.name == engine
    config = ReactorConfig(io_depth=2, open_ahead=4, read_segment=segment)
    assert config.requests_per_read(pool.slot_bytes) == (1 if not segment else -(-pool.slot_bytes // segment))
    reactor = Reactor(backend, pool, PosixMedium(tree), config=config, sink=sink, source=source)
    source.reactor = sink.reactor = reactor
    yield tree, reactor, sink
    reactor.close()
    pool.close()


def blocks(tree: KVTree, count: int, cls=StoreBlock):
    out = []
    for i in range(count):
        key = i.to_bytes(4, "big") * 8
        path = tree.block_path(NS.id, key)
        out.append(cls(path, NS.fingerprint, key, GEOMETRY))
    return out


def test_store_then_load_round_trip_through_a_small_pool(rig):
    tree, reactor, sink = rig
    reactor.write("s", blocks(tree, 10))
    stored = reactor.wait_for("s", timeout=30)
    assert stored.ok and stored.published == 10
    for b in blocks(tree, 10):
        assert check_block(b.path).header.key == b.key
    reactor.read("l", blocks(tree, 10, LoadBlock))
    loaded = reactor.wait_for("l", timeout=30)
    assert loaded.ok, loaded.failed
    assert sink.payloads == {i: pattern(i) for i in range(10)}
    assert sink.max_held <= 3
    assert reactor.pool.ledger.free == 3


def test_second_store_of_same_blocks_publishes_nothing_and_leaves_no_temps(rig):
    tree, reactor, _ = rig
    reactor.write(1, blocks(tree, 4))
    reactor.wait_for(1, timeout=30)
    reactor.write(2, blocks(tree, 4))
    again = reactor.wait_for(2, timeout=30)
    assert again.ok and again.published == 0
    names = [n for _, _, files in os.walk(tree.root) for n in files]
    assert not [n for n in names if is_temp_name(n)]


def test_missing_and_corrupt_blocks_fail_only_those_indices(rig):
    tree, reactor, sink = rig
    reactor.write("s", blocks(tree, 4))
    reactor.wait_for("s", timeout=30)
    load = blocks(tree, 5, LoadBlock)  # index 4 was never stored
    with open(load[1].path, "r+b") as f:  # payload bit flip
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 1]))
    os.truncate(load[2].path, HEADER_SIZE + 4096)  # truncated
    reactor.read("l", load)
    result = reactor.wait_for("l", timeout=30)
    assert set(result.failed) == {1, 2, 4}
    assert result.failed[1].corrupt and "checksum" in str(result.failed[1])
    assert result.failed[2].corrupt and "truncated" in str(result.failed[2])
    assert result.failed[4] == BlockFailure(Step.OPEN, errno.ENOENT, os.strerror(errno.ENOENT))
    assert "No such file" in str(result.failed[4]) and not result.failed[4].corrupt
    assert set(sink.payloads) == {0, 3}
    assert reactor.pool.ledger.free == 3


def test_header_only_verification_accepts_a_payload_flip(tmp_path):
    tree = KVTree.create(tmp_path)
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 2)
    sink, source = CopySink(), PatternSource()
    reactor = Reactor(open_backend("auto"), pool, PosixMedium(tree), config=ReactorConfig(verify="header"),
                      sink=sink, source=source)
    sink.reactor = source.reactor = reactor
    try:
        reactor.write("s", blocks(tree, 1))
        reactor.wait_for("s", timeout=30)
        path = blocks(tree, 1)[0].path
        with open(path, "r+b") as f:
            f.seek(HEADER_SIZE)
            f.write(b"\xff")
        reactor.read("l", blocks(tree, 1, LoadBlock))
        assert reactor.wait_for("l", timeout=30).ok
        assert sink.payloads[0][:1] == b"\xff"
    finally:
        reactor.close()
        pool.close()


def test_block_under_wrong_name_is_rejected(rig):
    tree, reactor, _ = rig
    reactor.write("s", blocks(tree, 2))
    reactor.wait_for("s", timeout=30)
    a, b = blocks(tree, 2, LoadBlock)
    os.replace(a.path, b.path)  # block 0's bytes under block 1's name
    reactor.read("l", [b])
    result = reactor.wait_for("l", timeout=30)
    assert result.failed[0].corrupt and "another block key" in str(result.failed[0])


def test_jobs_from_many_threads(rig):
    tree, reactor, sink = rig
    reactor.write("s", blocks(tree, 6))
    reactor.wait_for("s", timeout=30)
    results = {}

    def load(job: int) -> None:
        reactor.read(job, blocks(tree, 6, LoadBlock))
        results[job] = reactor.wait_for(job, timeout=30)

    threads = [threading.Thread(target=load, args=(j,)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok for r in results.values()) and len(results) == 4


def test_segmented_reads_issue_one_request_per_piece(tmp_path):
    """Split reads really go out as several requests; the payload is the same as one read's."""
    tree = KVTree.create(tmp_path)
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 2)
    sink, source = CopySink(), PatternSource()
    backend = open_backend("threadpool", depth=64)
    sizes: list[int] = []
    submit = backend.submit

    def counting_submit(requests):
        sizes.extend(r.length for r in requests if r.op.name == "READ")
        submit(requests)
    backend.submit = counting_submit
    reactor = Reactor(backend, pool, PosixMedium(tree),
                      config=ReactorConfig(io_depth=2, open_ahead=4, read_segment=4096), sink=sink, source=source)
    sink.reactor = source.reactor = reactor
    try:
        reactor.write("s", blocks(tree, 1))
        reactor.wait_for("s", timeout=30)
        reactor.read("l", blocks(tree, 1, LoadBlock))
        assert reactor.wait_for("l", timeout=30).ok
    finally:
        reactor.close()
        pool.close()
    assert sink.payloads == {0: pattern(0)}
    assert sizes == [4096] * (pool.slot_bytes // 4096)


@pytest.mark.parametrize("segment, depth, message", [(1000, 64, "multiple of 4096"), (4096, 8, "too small")])
def test_bad_segment_settings_are_refused(tmp_path, segment, depth, message):
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 2)
    backend = open_backend("threadpool", depth=depth)
    try:
        with pytest.raises(ValueError, match=message):
            Reactor(backend, pool, PosixMedium(KVTree.create(tmp_path)),
                    config=ReactorConfig(io_depth=2, read_segment=segment))
    finally:
        backend.close()
        pool.close()
