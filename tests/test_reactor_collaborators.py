"""The reactor's collaborators alone: ``Stores`` and ``Loads`` over a ``ReactorContext`` of stubs
(no reactor thread, no I/O backend, no medium calls), as the reactor hands them its actions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pykv.codec import codec_for
from pykv.failures import Step
from pykv.format import CODED_VERSION, FORMAT_VERSION, HEADER_SIZE, Geometry, build_header, decode_header, encode_header
from pykv.policy import Deliver, Fill, Kind
from pykv.reactor.context import ReactorContext
from pykv.reactor.loads import Loads
from pykv.reactor.stores import Stores
from pykv.reactor.types import JobResult, JobState, LoadBlock, StoreBlock, TransferState
from pykv.reactor.verify import seal_header
from pykv.staging import StagingPool, slot_bytes_for

GEOMETRY = Geometry(tokens=16, segments=2, segment_bytes=4096)
NS, KEY = bytes(16), b"k" * 16
ZSTD = codec_for("planes-zstd").params


class Policy:
    """Records what the collaborators tell the policy."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool]] = []

    def filled(self, tid: int, ok: bool) -> None:
        self.calls.append(("filled", tid, ok))

    def consumed(self, tid: int) -> None:
        self.calls.append(("consumed", tid, True))


class Verifier:
    """Seals on the calling thread."""

    def __init__(self) -> None:
        self.sealed: list[str] = []

    def seal(self, block, head, payload, done, *, codec="none"):
        self.sealed.append(codec)
        done(seal_header(block, head, payload, None, codec))


class Source:
    def __init__(self) -> None:
        self.requests, self.staged_blocks = [], []

    def fill(self, requests) -> None:
        self.requests.extend(requests)

    def staged(self, job, index) -> None:
        self.staged_blocks.append((job, index))


class Sink:
    def __init__(self) -> None:
        self.delivered = []

    def deliver(self, blocks) -> None:
        self.delivered.extend(blocks)


def context(pool: StagingPool) -> ReactorContext:
    return ReactorContext(backend=None, pool=pool, medium=None, policy=Policy(), verifier=Verifier(),
                          post=lambda command: command(), files=None, stats=Counter())


def transfer(ctx: ReactorContext, kind: Kind, block) -> tuple[int, TransferState]:
    t = TransferState(JobState(JobResult("job", kind, 1), 1, 0.0), 0, block)
    return ctx.add_transfer(t), t


def test_a_fill_names_the_blocks_target_and_a_coded_fill_is_sealed_with_its_codec():
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 2)
    ctx, source = context(pool), Source()
    stores = Stores(ctx, source)
    target = object()
    tid, t = transfer(ctx, Kind.STORE, StoreBlock(Path("b.kv"), NS, KEY, GEOMETRY, target=target, codec=ZSTD))
    stores.request_fill(Fill(tid, 1))
    assert [(r.slot, r.length, r.target) for r in source.requests] == [(1, GEOMETRY.payload_length, target)]
    pool.view(1)[HEADER_SIZE:HEADER_SIZE + 100] = b"s" * 100  # the source's 100 stored bytes
    stores.on_filled(tid, True, 100)
    header = decode_header(pool.view(1)[:HEADER_SIZE])
    assert (header.version, header.codec, header.payload_length) == (CODED_VERSION, ZSTD, 100)
    assert ctx.policy.calls == [("filled", tid, True)] and source.staged_blocks == [("job", 0)]
    assert t.expected == header.file_size and ctx.hashing == 0


def test_a_raw_fill_writes_the_header_of_pykv_before_codecs():
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 2)
    ctx = context(pool)
    stores = Stores(ctx, Source())
    tid, _ = transfer(ctx, Kind.STORE, StoreBlock(Path("b.kv"), NS, KEY, GEOMETRY, codec=ZSTD))
    stores.request_fill(Fill(tid, 0))
    stores.on_filled(tid, True)  # the source kept the payload raw
    assert decode_header(pool.view(0)[:HEADER_SIZE]).version == FORMAT_VERSION


def test_a_stored_length_no_header_can_describe_fails_the_fill_unsealed():
    for codec, stored in ((ZSTD, GEOMETRY.payload_length), (ZSTD, 0), ("none", 100)):
        pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 2)
        ctx = context(pool)
        stores = Stores(ctx, Source())
        tid, t = transfer(ctx, Kind.STORE, StoreBlock(Path("b.kv"), NS, KEY, GEOMETRY, codec=codec))
        stores.request_fill(Fill(tid, 0))
        stores.on_filled(tid, True, stored)
        assert t.job.result.failed[0].step is Step.FILL and ctx.verifier.sealed == []
        assert ctx.policy.calls == [("filled", tid, False)]


def test_no_source_fails_every_fill():
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 2)
    ctx = context(pool)
    tid, t = transfer(ctx, Kind.STORE, StoreBlock(Path("b.kv"), NS, KEY, GEOMETRY))
    Stores(ctx, None).request_fill(Fill(tid, 0))
    assert t.job.result.failed[0].step is Step.FILL


def test_a_delivery_hands_each_block_with_its_target_and_a_bad_preloaded_slot_is_a_failure():
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 3)
    ctx, sink = context(pool), Sink()
    loads = Loads(ctx, sink, read_segment=0, verify=False)
    payload = b"p" * GEOMETRY.payload_length
    header = build_header(NS, KEY, GEOMETRY, payload)
    target = object()
    good, t = transfer(ctx, Kind.LOAD, LoadBlock(Path("b.kv"), NS, KEY, GEOMETRY, target=target))
    t.header = header
    bad, u = transfer(ctx, Kind.LOAD, LoadBlock(Path("c.kv"), NS, b"c" * 16, GEOMETRY))  # preloaded: no header yet
    encode_header(header, pool.view(2))  # the slot names another key
    loads.deliver(Deliver([(good, 1), (bad, 2)]))
    assert [(b.transfer, b.slot, b.target) for b in sink.delivered] == [(good, 1, target)]
    assert u.job.result.failed[0].step is Step.CHECK and ctx.policy.calls == [("consumed", bad, True)]
    assert ctx.stats["delivered_blocks"] == 1
