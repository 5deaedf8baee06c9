"""Coded blocks in the format (header v3/v4, pykv/format_codec.py), the namespace and the config;
fsck and inspect over a tree holding one."""

from __future__ import annotations

import dataclasses
import json
import struct
import time

import pytest
import xxhash
from treefactory import GEOMETRY, NS, add_block, key, make_tree
from typer.testing import CliRunner

from pykv.auth import AuthStatus, check, load_key_ring, write_key_file
from pykv.blockfile import encode_block, read_payload, write_block
from pykv.codec import UnknownCodecError, codec_for
from pykv.codec.lossless import PlanesZstdCodec
from pykv.commands.app import app
from pykv.config import PykvConfig
from pykv.errors import ChecksumError, FormatError, InputError
from pykv.format import (CODEC_FIELD, CODED_VERSION, HEADER_SIZE, SIGNED_CODED_VERSION, Geometry, TruncatedError,
                         build_header, decode_header, encode_header, file_size, signed_parts, verify_payload)
from pykv.format_codec import MAX_RAW_PAYLOAD, PARAMS_BYTES, codec_from_params, decode_payload, unknown_bound
from pykv.maintenance.fsck import Problem, fsck
from pykv.maintenance.inspect import inspect_tree
from pykv.namespace import Namespace

NAMESPACE = bytes(range(16))
KEY = b"\xab\xcd" + bytes(range(30))
RAW = Geometry(tokens=16, segments=3, segment_bytes=1000)
PAYLOAD = bytes((i * 7 + 3) % 251 for i in range(RAW.payload_length))
CREATED = 1_700_000_000_123_456_789
ZSTD = PlanesZstdCodec()
STORED = ZSTD.encode(PAYLOAD)
UNKNOWN = "future-codec:v9,level=3"


def coded(params: str = ZSTD.params, stored: bytes = STORED, geometry: Geometry = RAW, **fields) -> bytes:
    header = build_header(NAMESPACE, KEY, geometry, stored, created_ns=CREATED, codec=params, **fields)
    data = encode_header(header)
    assert data is not None
    return data


def rechecked(data: bytearray) -> bytes:
    """``data`` with the header checksum of a coded header (bytes 0..151 and 208..463) recomputed."""
    struct.pack_into("<Q", data, 152, xxhash.xxh3_64_intdigest(bytes(data[:152]) + bytes(data[CODEC_FIELD])))
    return bytes(data)


def with_params(field: bytes) -> bytes:
    data = bytearray(coded())
    data[CODEC_FIELD] = field.ljust(PARAMS_BYTES, b"\0")
    return rechecked(data)


def with_stored_length(data: bytes, stored: int) -> bytes:
    edited = bytearray(data)
    struct.pack_into("<Q", edited, 104, stored)
    return rechecked(edited)


# -- codec none: v1/v2 as before codecs --------------------------------------------------------

def test_none_headers_are_byte_identical_to_those_before_codecs():
    """Digests of the v1 and v2 headers pykv wrote before codecs (same fields, same bytes)."""
    v1 = build_header(NAMESPACE, KEY, RAW, PAYLOAD, created_ns=CREATED)
    v2 = dataclasses.replace(build_header(NAMESPACE, KEY, RAW, PAYLOAD, created_ns=CREATED, key_id=b"k1"),
                             mac=b"\x11" * 32)
    assert (v1.version, v2.version, v1.codec, v1.coded) == (1, 2, "none", False)
    assert xxhash.xxh3_128_hexdigest(encode_header(v1)) == "55c9c2e7d7d44874abfec41dff964f1a"
    assert xxhash.xxh3_128_hexdigest(encode_header(v2)) == "ee942dfcb5f2ee73e53f2b6a55d3dede"
    assert build_header(NAMESPACE, KEY, RAW, PAYLOAD, created_ns=CREATED, codec="none") == v1
    assert decode_header(encode_header(v1)).raw_length == decode_header(encode_header(v1)).payload_length == 3000


def test_a_none_block_file_is_what_it_was(monkeypatch):
    monkeypatch.setattr(time, "time_ns", lambda: CREATED)
    data = encode_block(NAMESPACE, KEY, RAW, PAYLOAD, codec=codec_for("none"))
    assert data == encode_block(NAMESPACE, KEY, RAW, PAYLOAD)
    assert struct.unpack_from("<H", data, 8) == (1,)


# -- v3 / v4 round trips -----------------------------------------------------------------------

def test_coded_header_round_trip_and_offsets():
    data = coded()
    header = decode_header(data)
    assert header == build_header(NAMESPACE, KEY, RAW, STORED, created_ns=CREATED, codec=ZSTD.params)
    assert (header.version, header.codec, header.coded, header.signed) == (CODED_VERSION, ZSTD.params, True, False)
    assert header.payload_length == len(STORED) < header.raw_length == 3000
    assert header.file_size == file_size(len(STORED))
    assert struct.unpack_from("<HQ", data, 8)[0] == 3 and struct.unpack_from("<Q", data, 104) == (len(STORED),)
    assert struct.unpack_from("<IIQ", data, 112) == (16, 3, 1000)  # the raw payload's geometry
    assert data[CODEC_FIELD] == ZSTD.params.encode().ljust(256, b"\0") and CODEC_FIELD == slice(208, 464)
    assert not any(data[160:208]) and not any(data[464:])
    assert header.payload_checksum == xxhash.xxh3_128_digest(STORED)  # the stored bytes


def test_signed_coded_block_round_trip_and_its_mac_covers_the_codec_field(tmp_path):
    write_key_file(tmp_path / "keys", {"k1": bytes(range(32))})
    ring = load_key_ring(tmp_path / "keys")
    data = encode_block(NAMESPACE, KEY, RAW, PAYLOAD, keys=ring, codec=ZSTD)
    head, stored = data[:HEADER_SIZE], data[HEADER_SIZE:HEADER_SIZE + len(STORED)]
    header = decode_header(head)
    assert (header.version, header.key_id, header.codec) == (SIGNED_CODED_VERSION, b"k1", ZSTD.params)
    assert stored == STORED and len(data) == file_size(len(STORED))
    assert check(ring, header, head, stored) is AuthStatus.VALID
    parts = signed_parts(head)
    assert [bytes(p) for p in parts] == [head[:176], head[208:464]]
    other = bytearray(head)  # another codec's params under a recomputed header checksum: the MAC refuses it
    other[CODEC_FIELD] = UNKNOWN.encode().ljust(PARAMS_BYTES, b"\0")
    forged = rechecked(other)
    assert check(ring, decode_header(forged), forged, stored) is AuthStatus.BAD_MAC
    v2 = encode_block(NAMESPACE, KEY, RAW, PAYLOAD, keys=ring)[:HEADER_SIZE]
    assert [bytes(p) for p in signed_parts(v2)] == [v2[:176]]


def test_the_payload_checksum_covers_the_stored_bytes():
    header = decode_header(coded())
    verify_payload(header, STORED)
    damaged = bytearray(STORED)
    damaged[5] ^= 1
    with pytest.raises(ChecksumError):
        verify_payload(header, bytes(damaged))
    with pytest.raises(TruncatedError):
        verify_payload(header, STORED[:-1])


def test_decode_payload_restores_the_raw_payload_with_the_readers_codec():
    header = decode_header(coded())
    out = bytearray(RAW.payload_length)
    decode_payload(header, STORED + b"padding", out, ZSTD)
    assert bytes(out) == PAYLOAD
    with pytest.raises(FormatError, match="codec"):
        decode_payload(header, STORED, out, codec_for("none"))
    with pytest.raises(FormatError, match="3000 bytes"):
        decode_payload(header, STORED, bytearray(2000), ZSTD)


def test_unknown_and_fp8_codecs_decode_within_their_bounds():
    pytest.importorskip("torch")
    from pykv.codec.fp8 import Fp8Codec
    header = decode_header(coded(UNKNOWN, bytes(unknown_bound(3000))))
    assert header.codec == UNKNOWN and header.payload_length == unknown_bound(3000)
    fp8 = codec_from_params(Fp8Codec("bfloat16").params)
    assert isinstance(fp8, Fp8Codec) and (fp8.dtype, fp8.group) == ("bfloat16", 64)
    assert fp8.params == "fp8:v2,e4m3,group=64,scale=e8m0,dtype=bfloat16"
    groups = Geometry(tokens=4, segments=3, segment_bytes=2 * 64 * 5)  # 15 groups of 128 bytes
    bound = fp8.encoded_bound(groups.payload_length)
    assert bound == groups.payload_length // 2 + 15  # one scale byte per group
    assert decode_header(coded(fp8.params, bytes(bound), groups)).payload_length == bound
    with pytest.raises(FormatError, match="exceeds"):
        decode_header(with_stored_length(coded(fp8.params, bytes(bound), groups), bound + 1))
    with pytest.raises(FormatError, match="whole groups"):
        decode_header(with_params(fp8.params.encode()))  # 3000 raw bytes: not groups of 128
    fp16 = codec_from_params(Fp8Codec("float16", 8).params)  # 3000 bytes: 187.5 groups of 16
    assert isinstance(fp16, Fp8Codec) and (fp16.dtype, fp16.group) == ("float16", 8)
    with pytest.raises(FormatError, match="whole groups"):
        decode_header(with_params(fp16.params.encode()))
    fp16_25 = Fp8Codec("float16", 25).params  # 3000 bytes: 60 groups of 50
    assert decode_header(with_params(fp16_25.encode())).codec == fp16_25


@pytest.mark.parametrize("params", [
    "fp8:v2,e4m3,group=0,scale=e8m0,dtype=bfloat16",
    "fp8:v2,e4m3,group=abc,scale=e8m0,dtype=bfloat16",
    "fp8:v2,e4m3,group=,scale=e8m0,dtype=bfloat16",
    "fp8:v2,e4m3,group=-64,scale=e8m0,dtype=bfloat16",
    "fp8:v2,e4m3,group=064,scale=e8m0,dtype=bfloat16",
    "fp8:v2,e4m3,group=99999,scale=e8m0,dtype=bfloat16",
    "fp8:v2,e4m3,scale=e8m0,dtype=bfloat16",  # no group
    "fp8:v2,e4m3,group=64,dtype=bfloat16",  # no scale
    "fp8:v2,e4m3,group=64,scale=e8m0",  # no dtype
    "fp8:v2,group=64,scale=e8m0,dtype=bfloat16",  # no e4m3
    "fp8:v2,e4m3,group=64,scale=e8m0,dtype=float32",
    "fp8:v2,e4m3,group=64,scale=e8m0,dtype=bf16",
    "fp8:v2,e4m3,group=64,scale=f16,dtype=bfloat16",
    "fp8:v1,e4m3,group=64,scale=e8m0,dtype=bfloat16",
    "fp8:v2,e4m3,group=64,scale=f32,dtype=bfloat16",  # revision 2's float32 scales, before E8M0
    "fp8:v2,e4m3,group=64,scale=e8m0,dtype=bfloat16,extra=1",
    "fp8:v2,e4m3,dtype=bfloat16,group=64,scale=e8m0",  # the right fields in another order
    "fp8:v2,e4m3,group=64,scale=e8m0,dtype=bfloat16,group=64",
    "fp8",
    "fp8:",
    "fp8:v1,e4m3,scale=block-layer-head-kv,dtype=bfloat16,heads=2,tokens=4,head_dim=8,order=HNKD",  # v1
])
def test_fp8_params_that_are_not_exactly_a_codecs_are_not_built(params):
    pytest.importorskip("torch")
    assert codec_from_params(params) is None
    assert decode_header(with_params(params.encode())).codec == params  # an unknown codec's bound


# -- hostile headers ---------------------------------------------------------------------------

@pytest.mark.parametrize("field", [b"", b"none", b"planes\x80zstd", b"planes\0zstd", b"planes zstd", b"\x01",
                                   b"a" * 255 + b"\x7f"])
def test_bad_params_bytes_are_format_errors(field):
    with pytest.raises(FormatError, match="codec params") as info:
        decode_header(with_params(field))
    assert not isinstance(info.value, ChecksumError)


def test_params_of_256_visible_characters_are_the_limit():
    assert decode_header(with_params(b"x" * 256)).codec == "x" * 256
    with pytest.raises(ValueError, match="codec params"):
        coded("x" * 257, bytes(10))
    with pytest.raises(ValueError, match="codec params"):
        coded("planes-zstd:\u00e9", bytes(10))


@pytest.mark.parametrize("offset", [208, 220, 463])
def test_flipping_a_codec_byte_fails_the_header_checksum(offset):
    data = bytearray(coded())
    data[offset] ^= 0x01
    with pytest.raises(ChecksumError, match="header checksum"):
        decode_header(bytes(data))


def test_a_stored_length_over_the_codecs_bound_is_refused_without_allocating():
    bound = ZSTD.encoded_bound(3000)
    assert decode_header(with_stored_length(coded(), bound)).payload_length == bound
    for stored in (bound + 1, 1 << 40, (1 << 64) - 1):
        with pytest.raises(FormatError, match="exceeds"):
            decode_header(with_stored_length(coded(), stored))
    with pytest.raises(FormatError, match="exceeds"):
        decode_header(with_stored_length(coded(UNKNOWN, bytes(10)), unknown_bound(3000) + 1))


def test_a_huge_raw_length_is_refused_at_once():
    data = bytearray(coded())
    struct.pack_into("<IQ", data, 116, 0xFFFFFFFF, (1 << 64) - 1)  # segments x segment bytes: ~2^96
    started = time.monotonic()
    with pytest.raises(FormatError, match=str(MAX_RAW_PAYLOAD)):
        decode_header(rechecked(data))
    struct.pack_into("<IQ", data, 116, 1, MAX_RAW_PAYLOAD)  # the largest: its bound is still cheap
    assert decode_header(rechecked(data)).raw_length == MAX_RAW_PAYLOAD
    assert time.monotonic() - started < 1.0


def test_an_odd_raw_length_for_planes_zstd_is_a_format_error():
    data = bytearray(coded())
    struct.pack_into("<IQ", data, 116, 3, 999)
    with pytest.raises(FormatError, match="2-byte values"):
        decode_header(rechecked(data))


def test_versions_and_reserved_bytes():
    data = bytearray(coded())
    struct.pack_into("<H", data, 8, 5)  # an unknown version's checksum: taken as a v1's (bytes 0..151)
    struct.pack_into("<Q", data, 152, xxhash.xxh3_64_intdigest(bytes(data[:152])))
    with pytest.raises(FormatError, match="version 5"):
        decode_header(bytes(data))
    v1 = bytearray(encode_header(build_header(NAMESPACE, KEY, RAW, PAYLOAD, created_ns=CREATED)))
    struct.pack_into("<H", v1, 8, 3)  # a v1 header relabelled v3: its checksum does not cover the codec field
    with pytest.raises(ChecksumError):
        decode_header(bytes(v1))
    with pytest.raises(FormatError, match="codec params"):
        decode_header(rechecked(v1))  # ... and with one, it names no codec
    unsigned = bytearray(coded())
    unsigned[170] = 1  # a key id in an unsigned coded header
    with pytest.raises(FormatError, match="reserved"):
        decode_header(rechecked(unsigned))
    tail = bytearray(coded())
    tail[464] = 1
    with pytest.raises(FormatError, match="reserved"):
        decode_header(rechecked(tail))
    v1_with_params = bytearray(encode_header(build_header(NAMESPACE, KEY, RAW, PAYLOAD, created_ns=CREATED)))
    v1_with_params[208:212] = b"none"
    with pytest.raises(FormatError, match="reserved"):
        decode_header(bytes(v1_with_params))


def test_short_coded_headers_are_truncated():
    data = coded()
    with pytest.raises(TruncatedError) as info:
        decode_header(data[:300])
    assert info.value.expected is None
    with pytest.raises(TruncatedError) as info:
        decode_header(data[:1000])
    assert info.value.expected == file_size(len(STORED))


def test_build_header_refuses_what_decoding_would():
    with pytest.raises(ValueError, match="exceeds"):
        coded(stored=bytes(ZSTD.encoded_bound(3000) + 1))
    with pytest.raises(ValueError, match="stored length"):
        encode_header(dataclasses.replace(decode_header(coded()), stored_length=None))


# -- namespace ---------------------------------------------------------------------------------

def test_codec_none_keeps_the_fingerprints_of_before_codecs():
    plain = Namespace(model="test/model", dtype="bfloat16", kv_layout="NHD", tokens_per_block=16)
    engine = Namespace(model="hub:meta-llama/Llama-3.2-3B@default", dtype="bfloat16", kv_layout="LBHNC",
                       tokens_per_block=256, tp_size=2, tp_rank=1,
                       extra=(("block_hash_seed", "0123abcd"), ("platform", "cuda"), ("rank", 1),
                              *Namespace.codec_facts("none").items()))
    assert plain.id == "8cededbd70d6d23b05f7774d1f2748cf"  # the values pykv computed before codecs
    assert engine.id == "e3080feaa0a5e515654f8dd9aeeb175e"
    assert plain.codec == engine.codec == "none" and "codec" not in json.dumps(plain.describe())


def test_each_codec_is_a_namespace_of_its_own():
    zstd = dataclasses.replace(NS, extra=tuple(Namespace.codec_facts(ZSTD.params).items()))
    other = dataclasses.replace(NS, extra=tuple(Namespace.codec_facts(UNKNOWN).items()))
    assert len({NS.id, zstd.id, other.id}) == 3
    assert zstd.codec == ZSTD.params and Namespace.from_description(zstd.describe()) == zstd
    for bad in ("none", "bad params", ""):
        with pytest.raises(InputError, match="extra.codec"):
            dataclasses.replace(NS, extra=(("codec", bad),))


def test_namespace_for_threads_the_codec_through():
    pytest.importorskip("vllm")
    from reliability.connector_rig import offloading_config

    from pykv.connector.layout import namespace_for
    config = offloading_config("/unused")
    plain = namespace_for(config, rank=0)
    assert namespace_for(config, rank=0, codec="none") == plain and plain.codec == "none"
    zstd = namespace_for(config, rank=0, codec=ZSTD.params)
    assert zstd.codec == ZSTD.params and zstd.id != plain.id


# -- config ------------------------------------------------------------------------------------

def test_config_codec_key():
    assert PykvConfig.from_extra_config({"root": "/r"}).codec == "none"
    config = PykvConfig.from_extra_config({"root": "/r", "codec": "planes-zstd"})
    assert config.codec == "planes-zstd" and PykvConfig.from_extra_config(config.to_extra_config()) == config
    for bad in ("zstd", "", 3, None):
        with pytest.raises(UnknownCodecError) as info:
            PykvConfig.from_extra_config({"root": "/r", "codec": bad})
        message = str(info.value)
        assert message.startswith("kv_connector_extra_config.codec: unknown codec")
        assert "none, planes-zstd, fp8" in message and "\n" not in message


# -- fsck and inspect --------------------------------------------------------------------------

def coded_tree(tmp_path):
    space = dataclasses.replace(NS, extra=tuple(Namespace.codec_facts(ZSTD.params).items()))
    tree = make_tree(tmp_path, NS, space)
    add_block(tree, key(0))
    payload = bytes(GEOMETRY.payload_length)  # zeros: compresses
    assert write_block(tree, space.id, key(1), GEOMETRY, payload, codec=ZSTD)
    path = tree.block_path(space.id, key(1))
    header, stored = read_payload(path)
    assert header.codec == ZSTD.params and len(stored) < GEOMETRY.payload_length
    assert path.stat().st_size == file_size(len(stored))
    return tree, space, path


def test_fsck_checks_a_coded_block_and_counts_it(tmp_path):
    tree, _, path = coded_tree(tmp_path)
    report = fsck(tree)
    assert report.clean and report.blocks_checked == 2
    assert report.as_dict()["codecs"] == {ZSTD.params: 1}
    result = CliRunner().invoke(app, ["fsck", str(tree.root)])
    assert result.exit_code == 0 and f"coded: 1 block {ZSTD.params}" in result.output
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 3] ^= 1  # a stored byte
    path.write_bytes(bytes(data))
    assert [f.problem for f in fsck(tree).findings] == [Problem.BAD_CHECKSUM]


def test_fsck_reports_a_stored_length_over_the_bound_as_a_bad_header(tmp_path):
    tree, _, path = coded_tree(tmp_path)
    data = path.read_bytes()
    bound = ZSTD.encoded_bound(GEOMETRY.payload_length)
    over = with_stored_length(data[:HEADER_SIZE], bound + 1)
    path.write_bytes(over + bytes(file_size(bound + 1) - HEADER_SIZE))
    (finding,) = fsck(tree).findings
    assert finding.problem is Problem.BAD_HEADER and "exceeds" in finding.detail
    none_report = fsck(make_tree(tmp_path / "plain"))
    assert "codecs" not in none_report.as_dict()


def test_inspect_names_the_codec_of_a_namespace(tmp_path):
    tree, space, _ = coded_tree(tmp_path)
    by_id = {s.id: s for s in inspect_tree(tree).namespaces}
    assert by_id[space.id].description == "test/model bfloat16 tp0/1 pp0 16 tokens/block codec planes-zstd"
    assert by_id[space.id].fields["extra.codec"] == ZSTD.params
    assert by_id[NS.id].description == "test/model bfloat16 tp0/1 pp0 16 tokens/block"
    result = CliRunner().invoke(app, ["inspect", "--json", str(tree.root)])
    assert result.exit_code == 0
    described = {ns["id"]: ns["description"] for ns in json.loads(result.output)["namespaces"]}
    assert described[space.id].endswith("codec planes-zstd")
