"""Format v1: header encode/decode, checksums, sizes (pykv/format.py)."""

from __future__ import annotations

import struct

import pytest
import xxhash

from pykv.errors import ChecksumError, FormatError
from pykv.format import (
    HEADER_SIZE,
    MAGIC,
    BlockHeader,
    Geometry,
    TruncatedError,
    build_header,
    decode_header,
    encode_header,
    file_size,
    padded,
    payload_checksum,
    verify_payload,
)

NAMESPACE = bytes(range(16))
KEY = b"\xab\xcd" + bytes(range(30))
GEOMETRY = Geometry(tokens=16, segments=3, segment_bytes=1000)
PAYLOAD = bytes((i * 7 + 3) % 251 for i in range(GEOMETRY.payload_length))
CREATED = 1_700_000_000_123_456_789


def make_header(**changes) -> BlockHeader:
    fields = dict(namespace=NAMESPACE, key=KEY, geometry=GEOMETRY, payload=PAYLOAD, created_ns=CREATED)
    fields.update(changes)
    return build_header(fields.pop("namespace"), fields.pop("key"), fields.pop("geometry"),
                        fields.pop("payload"), **fields)


def encoded(header: BlockHeader | None = None) -> bytes:
    data = encode_header(header or make_header())
    assert data is not None
    return data


def with_header_checksum(data: bytearray) -> bytearray:
    """Recompute the xxh3-64 header checksum at offset 152 after an edit."""
    struct.pack_into("<Q", data, 152, xxhash.xxh3_64_intdigest(bytes(data[:152])))
    return data


# -- round trip --------------------------------------------------------------------------------

def test_round_trip_through_bytes():
    header = make_header()
    data = encoded(header)
    assert isinstance(data, bytes)
    assert len(data) == HEADER_SIZE
    assert decode_header(data) == header


def test_round_trip_into_memoryview_out_zeroes_the_header_and_leaves_the_rest():
    header = make_header()
    buffer = bytearray(b"\xff" * (2 * HEADER_SIZE))
    assert encode_header(header, out=memoryview(buffer)) is None
    assert bytes(buffer[:HEADER_SIZE]) == encoded(header)
    assert buffer[HEADER_SIZE:] == b"\xff" * HEADER_SIZE
    assert decode_header(memoryview(buffer)) == header


def test_decode_accepts_a_memoryview_of_the_encoded_bytes():
    header = make_header()
    assert decode_header(memoryview(encoded(header))) == header


def test_every_header_field_at_its_documented_offset():
    header = make_header()
    data = encoded(header)
    assert data[0:8] == MAGIC == b"PYKVBLK\0"
    assert struct.unpack_from("<H", data, 8) == (1,)
    assert struct.unpack_from("<H", data, 10) == (4096,)
    assert struct.unpack_from("<I", data, 12) == (0,)
    assert data[16:32] == NAMESPACE
    assert struct.unpack_from("<H", data, 32) == (len(KEY),)
    assert data[34:40] == bytes(6)
    assert data[40:40 + len(KEY)] == KEY
    assert data[40 + len(KEY):104] == bytes(64 - len(KEY))
    assert struct.unpack_from("<Q", data, 104) == (GEOMETRY.payload_length,)
    assert struct.unpack_from("<I", data, 112) == (GEOMETRY.tokens,)
    assert struct.unpack_from("<I", data, 116) == (GEOMETRY.segments,)
    assert struct.unpack_from("<Q", data, 120) == (GEOMETRY.segment_bytes,)
    assert data[128:144] == xxhash.xxh3_128_digest(PAYLOAD)
    assert struct.unpack_from("<Q", data, 144) == (CREATED,)
    assert struct.unpack_from("<Q", data, 152) == (xxhash.xxh3_64_intdigest(data[:152]),)
    assert data[160:] == bytes(HEADER_SIZE - 160)


def test_decoded_fields():
    decoded = decode_header(encoded())
    assert decoded.namespace == NAMESPACE
    assert decoded.key == KEY
    assert decoded.geometry == GEOMETRY
    assert decoded.payload_length == 3000
    assert decoded.payload_checksum == xxhash.xxh3_128_digest(PAYLOAD)
    assert decoded.created_ns == CREATED
    assert decoded.version == 1
    assert decoded.file_size == HEADER_SIZE + 4096


@pytest.mark.parametrize("key", [b"\x01", bytes(range(64))])
def test_key_length_bounds_round_trip(key):
    header = make_header(key=key)
    assert decode_header(encoded(header)).key == key


def test_build_header_stamps_creation_time_when_not_given():
    header = build_header(NAMESPACE, KEY, GEOMETRY, PAYLOAD)
    assert header.created_ns > 1_600_000_000 * 10**9


def test_build_header_rejects_payload_not_matching_geometry():
    with pytest.raises(ValueError, match="geometry"):
        build_header(NAMESPACE, KEY, GEOMETRY, PAYLOAD[:-1])


# -- rejection ---------------------------------------------------------------------------------

def test_bad_magic_is_a_format_error_naming_the_path():
    data = bytearray(encoded())
    data[0:8] = b"NOTPYKV\0"
    with pytest.raises(FormatError, match="magic") as info:
        decode_header(bytes(with_header_checksum(data)), path="/x/y.kv")
    assert not isinstance(info.value, ChecksumError)
    assert info.value.path == "/x/y.kv"
    assert "/x/y.kv" in str(info.value)


@pytest.mark.parametrize("offset", [0, 5, 8, 11, 12, 16, 31, 32, 34, 39, 40, 77, 103, 104,
                                    112, 116, 120, 128, 143, 144, 151, 152, 155, 159])
@pytest.mark.parametrize("bit", [0, 7])
def test_header_bit_flip_is_detected(offset, bit):
    data = bytearray(encoded())
    data[offset] ^= 1 << bit
    with pytest.raises(FormatError) as info:  # ChecksumError is a FormatError
        decode_header(bytes(data))
    if offset < 8:
        assert "magic" in info.value.reason
    else:
        assert isinstance(info.value, ChecksumError)


@pytest.mark.parametrize("version", [0, 5, 0xFFFF])
def test_other_version_with_valid_checksum_is_a_format_error_naming_the_version(version):
    data = bytearray(encoded())
    struct.pack_into("<H", data, 8, version)
    with pytest.raises(FormatError, match="version") as info:
        decode_header(bytes(with_header_checksum(data)))
    assert not isinstance(info.value, ChecksumError)
    assert str(version) in str(info.value)


def test_header_shorter_than_checked_part_is_truncated():
    with pytest.raises(FormatError, match="truncated"):
        decode_header(encoded()[:159])


@pytest.mark.parametrize("cut", [0, 1, 7, 100, 159])
def test_a_file_cut_before_the_header_checksum_is_truncated_without_a_size(cut):
    with pytest.raises(TruncatedError) as info:
        decode_header(encoded()[:cut], path="/x/y.kv")
    assert (info.value.size, info.value.expected) == (cut, None)
    assert str(info.value) == f"/x/y.kv: truncated: {cut} of at least 4096 bytes (a header)"


@pytest.mark.parametrize("cut", [160, 208, 1000, HEADER_SIZE // 2, HEADER_SIZE - 1])
def test_a_file_cut_inside_the_header_is_truncated_to_the_size_its_header_says(cut):
    with pytest.raises(TruncatedError) as info:  # not "reserved header bytes are not zero"
        decode_header(encoded()[:cut])
    assert (info.value.size, info.value.expected) == (cut, file_size(GEOMETRY.payload_length))
    assert info.value.reason == f"truncated: {cut} of {file_size(GEOMETRY.payload_length)} bytes"


def test_a_short_file_that_is_no_pykv_header_is_not_called_truncated():
    with pytest.raises(FormatError, match="bad magic") as info:
        decode_header(b"\x80\x04pickle")
    assert not isinstance(info.value, TruncatedError)
    damaged = bytearray(encoded()[:1000])
    damaged[50] ^= 1
    with pytest.raises(ChecksumError, match="header checksum"):
        decode_header(bytes(damaged))


def test_nonzero_flags_with_valid_checksum_is_rejected():
    data = bytearray(encoded())
    struct.pack_into("<I", data, 12, 1)
    with pytest.raises(FormatError, match="flags"):
        decode_header(bytes(with_header_checksum(data)))


def test_inconsistent_payload_length_with_valid_checksum_is_rejected():
    data = bytearray(encoded())
    struct.pack_into("<Q", data, 104, GEOMETRY.payload_length + 1)
    with pytest.raises(FormatError, match="payload length"):
        decode_header(bytes(with_header_checksum(data)))


@pytest.mark.parametrize("key_length", [0, 65])
def test_bad_key_length_with_valid_checksum_is_rejected(key_length):
    data = bytearray(encoded())
    struct.pack_into("<H", data, 32, key_length)
    with pytest.raises(FormatError, match="key length"):
        decode_header(bytes(with_header_checksum(data)))


@pytest.mark.parametrize("key", [b"", bytes(65)])
def test_encode_rejects_key_of_length_0_or_65(key):
    header = BlockHeader(namespace=NAMESPACE, key=key, geometry=GEOMETRY,
                         payload_checksum=payload_checksum(PAYLOAD))
    with pytest.raises(ValueError, match="key"):
        encode_header(header)
    with pytest.raises(ValueError, match="key"):
        encode_header(header, out=bytearray(HEADER_SIZE))


def test_encode_rejects_wrong_namespace_length():
    header = BlockHeader(namespace=bytes(15), key=KEY, geometry=GEOMETRY,
                         payload_checksum=payload_checksum(PAYLOAD))
    with pytest.raises(ValueError, match="namespace"):
        encode_header(header)


# -- payload -----------------------------------------------------------------------------------

def test_verify_payload_accepts_matching_payload_and_ignores_padding():
    header = make_header()
    verify_payload(header, PAYLOAD)
    verify_payload(header, memoryview(PAYLOAD + bytes(padded(len(PAYLOAD)) - len(PAYLOAD))))


def test_payload_checksum_mismatch_is_a_checksum_error():
    header = make_header()
    corrupted = bytearray(PAYLOAD)
    corrupted[1234] ^= 0x10
    with pytest.raises(ChecksumError, match="payload checksum") as info:
        verify_payload(header, bytes(corrupted), path="blk.kv")
    assert info.value.path == "blk.kv"


def test_truncated_payload_is_a_format_error_not_a_checksum_error():
    header = make_header()
    with pytest.raises(TruncatedError, match="truncated") as info:
        verify_payload(header, PAYLOAD[:-1])
    assert not isinstance(info.value, ChecksumError)
    assert (info.value.size, info.value.expected) == (HEADER_SIZE + len(PAYLOAD) - 1, header.file_size)


def test_payload_checksum_is_xxh3_128():
    assert payload_checksum(PAYLOAD) == xxhash.xxh3_128_digest(PAYLOAD)
    assert payload_checksum(memoryview(PAYLOAD)) == xxhash.xxh3_128(PAYLOAD).digest()
    assert len(payload_checksum(PAYLOAD)) == 16
    assert payload_checksum(b"") == xxhash.xxh3_128_digest(b"")
    assert make_header().payload_checksum == xxhash.xxh3_128_digest(PAYLOAD)
    assert payload_checksum(PAYLOAD) != xxhash.xxh3_64_digest(PAYLOAD)


# -- sizes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("length, expected", [(0, 0), (1, 4096), (4095, 4096), (4096, 4096),
                                              (4097, 8192), (3 * 4096, 3 * 4096), (10**6, 1003520)])
def test_padded(length, expected):
    assert padded(length) == expected


@pytest.mark.parametrize("length, expected", [(0, 4096), (1, 8192), (4096, 8192), (4097, 12288)])
def test_file_size(length, expected):
    assert file_size(length) == expected


def test_geometry_payload_length():
    assert Geometry(tokens=16, segments=64, segment_bytes=32768).payload_length == 64 * 32768


# -- signed headers (v2) -----------------------------------------------------------------------

def test_a_signed_header_round_trips_with_its_key_id_and_mac():
    header = make_header(key_id=b"2026-12")
    header = BlockHeader(header.namespace, header.key, header.geometry, header.payload_checksum, header.created_ns,
                         header.key_id, bytes(range(32)))
    data = encoded(header)
    assert struct.unpack_from("<H", data, 8) == (2,) and data[160:176] == b"2026-12".ljust(16, b"\0")
    assert data[176:208] == bytes(range(32)) and not any(data[208:])
    assert decode_header(data) == header and decode_header(data).signed and decode_header(data).version == 2


@pytest.mark.parametrize("key_id", [b"", b"k\0x", b"k/1", b"\xff"])
def test_a_signed_header_with_a_bad_key_id_is_refused(key_id):
    data = bytearray(encoded(make_header(key_id=b"k1")))
    data[160:176] = key_id.ljust(16, b"\0")
    with pytest.raises(FormatError, match="bad key id"):
        decode_header(bytes(data))


def test_an_unsigned_header_with_bytes_where_a_signed_one_has_its_mac_is_refused():
    data = bytearray(encoded())
    data[176] = 1
    with pytest.raises(FormatError, match="reserved header bytes"):
        decode_header(bytes(data))
    signed = bytearray(encoded(make_header(key_id=b"k1")))
    signed[208] = 1
    with pytest.raises(FormatError, match="reserved header bytes"):
        decode_header(bytes(signed))


@pytest.mark.parametrize("position", [160, 2048, 4095])
@pytest.mark.parametrize("as_view", [False, True])
def test_any_nonzero_byte_after_the_fields_is_refused(position, as_view):
    data = bytearray(encoded())
    assert decode_header(memoryview(data) if as_view else bytes(data)).key == make_header().key
    data[position] = 0x80
    with pytest.raises(FormatError, match="reserved header bytes"):
        decode_header(memoryview(data) if as_view else bytes(data))
