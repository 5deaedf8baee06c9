"""BlockStore with a codec client (the worker's CodecStage, no vLLM, no torch): stores are written
as coded blocks (header v3) and load back bit-exact, from disk and from DRAM-tier slots; blocks
a client cannot decode, or a client's impossible stored length, never become KV."""

from __future__ import annotations

import os

import pytest
from test_codec_stage import kv_like
from test_store import NS, Client, store  # noqa: F401  (fixture)

from pykv.blockfile import read_header, read_payload
from pykv.codec import codec_for
from pykv.codec.stage import CodecStage
from pykv.failures import Step
from pykv.format import CODED_VERSION, FORMAT_VERSION, HEADER_SIZE, Geometry, build_header, encode_header, file_size
from pykv.staging import slot_bytes_for
from pykv.store import BlockRef, BlockStore, EngineShape

GEOMETRY = Geometry(tokens=64, segments=4, segment_bytes=64 << 10)
KEYS = [bytes([9, i]) * 16 for i in range(3)]
CODEC = codec_for("planes-zstd")


def payload(key: bytes) -> bytes:
    return kv_like(GEOMETRY.payload_length, seed=key[1])


class CodecClient(Client):
    """The worker's codec steps over byte copies: encode after the copy in, decode before the copy out."""

    stage: CodecStage
    stored_override: int | None = None

    def to_slots(self, copies, done):
        for c in copies:
            view = self.store.pool.view(c.slot)[HEADER_SIZE:HEADER_SIZE + c.length]
            view[:] = payload(self.jobs[c.job][c.index])
            if self.stored_override is not None:
                done(c, True, self.stored_override)
                continue
            self.stage.encode(view, lambda stored, c=c: done(c, True, stored=stored))

    def from_slots(self, copies, done):
        for c in copies:
            stored = self.store.pool.view(c.slot)[HEADER_SIZE:HEADER_SIZE + c.length]
            if c.codec == "none":
                self.loaded[self.jobs[c.job][c.index]] = bytes(stored)
                done(c, True)
                continue
            self.stage.decode(stored, c.decoded_length, c.codec,
                              lambda buffer, failure, c=c: self._decoded(c, buffer, failure, done))

    def _decoded(self, c, buffer, failure, done):
        if buffer is None:
            done(c, False, failure=failure)
            return
        self.loaded[self.jobs[c.job][c.index]] = bytes(self.stage.view(buffer)[:c.decoded_length])
        self.stage.release(buffer)
        done(c, True)


@pytest.fixture
def coded(tmp_path):
    made = []

    def make(dram_slots: int = 0, codec: str = CODEC.params) -> tuple[BlockStore, CodecClient]:
        from pykv.config import PykvConfig
        (tmp_path / "tree").mkdir(exist_ok=True)
        config = PykvConfig.from_extra_config({"root": str(tmp_path / "tree"), "io_engine": "threadpool"})
        client = CodecClient()
        client.stage = CodecStage(CODEC, slot_bytes_for(GEOMETRY.payload_length), threads=2)
        shape = EngineShape(NS, slot_bytes_for(GEOMETRY.payload_length), 4, dram_slots, codec=codec)
        client.store = BlockStore(config, shape, client)
        made.append(client)
        return client.store, client
    yield make
    for client in made:
        client.store.close()
        client.stage.close()


def submit(block_store, client, job, keys, *, load, dram=None, resident=False):
    client.jobs[job] = list(keys)
    refs = [BlockRef(k, GEOMETRY, None if dram is None else dram[i], resident) for i, k in enumerate(keys)]
    return block_store.load_blocks(job, refs) if load else block_store.store_blocks(job, refs)


def test_stores_are_coded_blocks_that_load_back_bit_exact(coded):
    s, client = coded()
    submit(s, client, 1, KEYS, load=False)
    assert not client.wait(1).failures
    for k in KEYS:
        header = read_header(s.devices[0].block_path(NS.id, k))
        assert header.version == CODED_VERSION and header.codec == CODEC.params
        assert header.payload_length < 0.9 * GEOMETRY.payload_length and header.raw_length == GEOMETRY.payload_length
    submit(s, client, 2, KEYS, load=True)
    assert not client.wait(2).failures
    assert client.loaded == {k: payload(k) for k in KEYS}


def test_a_dram_tier_slot_keeps_its_stored_bytes_and_serves_every_hit(coded):
    s, client = coded(dram_slots=4)
    submit(s, client, 1, KEYS, load=False, dram=[0, 1, 2])
    client.wait(1)
    for k in KEYS:
        os.unlink(s.devices[0].block_path(NS.id, k))  # only the DRAM tier can serve now
    for job in (2, 3):  # a load never changes the slot: the second hit decodes the same bytes
        client.loaded.clear()
        submit(s, client, job, KEYS, load=True, dram=[0, 1, 2], resident=True)
        assert not client.wait(job).failures and client.loaded == {k: payload(k) for k in KEYS}
    assert s.stats()["dram_delivered_blocks"] == 6 and s.reactor.stats["disk_reads"] == 0


def test_a_block_the_client_cannot_decode_is_a_miss_and_quarantined(coded, tmp_path):
    s, client = coded()
    submit(s, client, 1, KEYS[:1], load=False)
    client.wait(1)
    path = s.devices[0].block_path(NS.id, KEYS[0])
    header, stored = read_payload(path)
    damaged = bytes(64) + stored[64:]  # the plane table zeroed, under a header whose checksums match
    forged = build_header(header.namespace, header.key, header.geometry, damaged, codec=CODEC.params)
    path.write_bytes(encode_header(forged) + damaged + bytes(file_size(len(damaged)) - HEADER_SIZE - len(damaged)))
    assert read_payload(path)[1] == damaged, "a valid block file as far as the format can tell"
    submit(s, client, 2, KEYS[:1], load=True)
    end = client.wait(2)
    assert end.failures[0].step is Step.CHECK and KEYS[0] not in client.loaded
    assert not path.exists() and s.counters["quarantined"] == 1, "undecodable: quarantined like a corrupt file"


def test_a_client_stored_length_no_header_can_describe_fails_the_store(coded):
    s, client = coded()
    client.stored_override = GEOMETRY.payload_length  # "encoded" to the raw length: a client's bug
    submit(s, client, 1, KEYS[:1], load=False)
    end = client.wait(1)
    assert end.failures and not s.devices[0].block_path(NS.id, KEYS[0]).exists()


def test_an_engine_without_a_codec_writes_the_headers_it_always_wrote(store):  # noqa: F811
    s, client = store()
    client.jobs[1] = KEYS[:1]
    s.store_blocks(1, [BlockRef(KEYS[0], Geometry(tokens=64, segments=2, segment_bytes=4096))])
    client.wait(1)
    assert read_header(s.devices[0].block_path(NS.id, KEYS[0])).version == FORMAT_VERSION
