"""On-disk block format: a fixed 4 KiB header followed by the stored payload, padded to 4 KiB.

Layout of the header (little endian; the rest of the 4 KiB is zero). Header version 1 is an
unsigned block; version 2 is a signed block (``auth_key_file``, ``pykv.auth``): the same
fields plus a key id and a keyed BLAKE3 MAC at 160..207. Versions 3 (unsigned) and 4 (signed)
are coded blocks (``pykv.format_codec``): the payload is stored as a codec wrote it, the codec's
``params`` at 208..463, and the payload length at 104 counts the stored bytes (the raw payload
stays segments x segment_bytes). A block of codec ``none`` is version 1 or 2. All live in tree
format 1.

======  ====  =================================================================
offset  size  field
======  ====  =================================================================
0       8     magic ``b"PYKVBLK\\0"``
8       2     header version (1 unsigned, 2 signed, 3 coded, 4 coded and signed)
10      2     header size in bytes (4096)
12      4     flags (0)
16      16    namespace fingerprint
32      2     block key length (1..64)
34      6     reserved (zero)
40      64    block key, zero padded
104     8     stored payload length in bytes (unpadded; v1/v2: segments x segment bytes)
112     4     tokens in the storage block
116     4     segments (payload = segments x segment_bytes)
120     8     segment bytes
128     16    xxh3-128 of the stored payload (unpadded)
144     8     creation time, nanoseconds since the epoch
152     8     xxh3-64 of bytes 0..151 (v3/v4: then 208..463): the header checksum
160     16    v2/v4: key id (ASCII, zero padded); v1/v3: zero
176     32    v2: BLAKE3 keyed MAC of bytes 0..175 and the payload; v4: of bytes
              0..175, 208..463 and the stored payload; v1/v3: zero
208     256   v3/v4: the codec's ``params`` (visible ASCII, zero padded); v1/v2: zero
======  ====  =================================================================

Files are raw bytes only: nothing here ever unpickles or ``torch.load``s.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import xxhash

from pykv.errors import ChecksumError, FormatError
from pykv.format_codec import NONE, PARAMS_BYTES, check_stored, decode_params, encode_params

MAGIC = b"PYKVBLK\0"
FORMAT_VERSION = 1
"""The tree's format (marker, namespace fingerprints) and the header version of unsigned blocks."""
SIGNED_VERSION = 2
"""The header version of a signed block: a v1 header plus key id and MAC (older pykv refuses it)."""
CODED_VERSION = 3
"""The header version of an unsigned coded block: a v1 header plus the codec's params."""
SIGNED_CODED_VERSION = 4
"""The header version of a signed coded block: a v2 header plus the codec's params."""
VERSIONS = (FORMAT_VERSION, SIGNED_VERSION, CODED_VERSION, SIGNED_CODED_VERSION)
HEADER_SIZE = 4096
ALIGNMENT = 4096
MAX_KEY_BYTES = 64
NAMESPACE_BYTES = 16

_BODY = struct.Struct("<8sHHI16sH6x64sQIIQ16sQ")
_CHECKSUM = struct.Struct("<Q")
_CHECKED_BYTES = _BODY.size  # 152
assert _CHECKED_BYTES == 152
_RESERVED = slice(34, 40)  # the 6 reserved bytes after the key length
_TRAILER = _CHECKED_BYTES + _CHECKSUM.size  # 160: end of the v1 header's fields
_ZERO_HEADER = bytes(HEADER_SIZE)  # compared as a whole: ``any`` over 3.9 KiB took ~20 µs a block
KEY_ID_BYTES = 16
MAC_BYTES = 32
KEY_ID_FIELD = slice(_TRAILER, _TRAILER + KEY_ID_BYTES)  # 160..175
MAC_FIELD = slice(KEY_ID_FIELD.stop, KEY_ID_FIELD.stop + MAC_BYTES)  # 176..207
SIGNED_BYTES = KEY_ID_FIELD.stop
"""The header bytes a signed block's MAC covers (0..175: every field, the key id included), before the
payload; and a coded block's ``CODEC_FIELD`` (``signed_parts``)."""
CODEC_FIELD = slice(MAC_FIELD.stop, MAC_FIELD.stop + PARAMS_BYTES)  # 208..463
KEY_ID_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


class TruncatedError(FormatError):
    """A block file shorter than its header says (``expected`` bytes), or too short to say
    (``expected`` None: less than the header's checked fields)."""

    def __init__(self, path: object, size: int, expected: int | None) -> None:
        self.size, self.expected = size, expected
        super().__init__(path, f"truncated: {size} of {expected} bytes" if expected is not None
                         else f"truncated: {size} of at least {HEADER_SIZE} bytes (a header)")


class OversizedError(FormatError):
    """A block file longer than its header says."""

    def __init__(self, path: object, size: int, expected: int) -> None:
        self.size, self.expected = size, expected
        super().__init__(path, f"oversized: {size} bytes, header says {expected}")


def check_file_size(path: object, size: int, header: BlockHeader) -> None:
    """Raise ``TruncatedError``/``OversizedError`` unless the file's ``size`` is what ``header`` says."""
    if size < header.file_size:
        raise TruncatedError(path, size, header.file_size)
    if size > header.file_size:
        raise OversizedError(path, size, header.file_size)


def padded(length: int) -> int:
    """``length`` rounded up to the 4 KiB alignment."""
    return -(-length // ALIGNMENT) * ALIGNMENT


def file_size(payload_length: int) -> int:
    """Exact size of a v1 file carrying ``payload_length`` payload bytes."""
    return HEADER_SIZE + padded(payload_length)


@dataclass(frozen=True, slots=True)
class Geometry:
    """Shape of a payload: ``segments`` equal pieces of ``segment_bytes`` for ``tokens`` tokens."""

    tokens: int
    segments: int
    segment_bytes: int

    @property
    def payload_length(self) -> int:
        return self.segments * self.segment_bytes


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The parsed header of one storage block file. ``codec``: the ``params`` of the codec that
    stored the payload (``none``: stored as it is); ``stored_length``: a coded block's stored bytes."""

    namespace: bytes
    key: bytes
    geometry: Geometry
    payload_checksum: bytes
    created_ns: int = 0
    key_id: bytes = b""  # signed blocks (v2, v4): the key that made ``mac``; b"" for unsigned (v1, v3)
    mac: bytes = b""
    codec: str = NONE
    stored_length: int | None = None  # coded blocks (v3, v4); None: the raw payload is stored

    @property
    def version(self) -> int:
        if self.coded:
            return SIGNED_CODED_VERSION if self.key_id else CODED_VERSION
        return SIGNED_VERSION if self.key_id else FORMAT_VERSION

    @property
    def signed(self) -> bool:
        return bool(self.key_id)

    @property
    def coded(self) -> bool:
        return self.codec != NONE

    @property
    def payload_length(self) -> int:
        """The stored payload's bytes (what the file holds after the header, the checksum and MAC cover)."""
        return self.geometry.payload_length if self.stored_length is None else self.stored_length

    @property
    def raw_length(self) -> int:
        """The payload's bytes once decoded (segments x segment bytes)."""
        return self.geometry.payload_length

    @property
    def file_size(self) -> int:
        return file_size(self.payload_length)


def payload_checksum(payload: memoryview | bytes) -> bytes:
    """xxh3-128 digest (16 bytes) of ``payload``."""
    return xxhash.xxh3_128_digest(payload)


def valid_key_id(key_id: bytes) -> bool:
    """1..16 bytes of letters, digits, ``.``, ``_`` or ``-``."""
    return 1 <= len(key_id) <= KEY_ID_BYTES and all(c in KEY_ID_CHARS for c in key_id)


def build_header(namespace: bytes, key: bytes, geometry: Geometry, payload: memoryview | bytes,
                 *, created_ns: int | None = None, key_id: bytes = b"", codec: str = NONE) -> BlockHeader:
    """Header for ``payload`` (its checksum is computed here); ``key_id``: a signed header, whose
    MAC ``pykv.auth.sign`` writes once it is encoded. ``codec``: the ``params`` of the codec that
    made ``payload`` (the stored bytes) from the raw payload of ``geometry``; ``none``: ``payload``
    is the raw payload."""
    stored_length = None
    if codec != NONE:
        encode_params(codec)  # ValueError for params no header can hold
        try:
            check_stored("new header", codec, len(payload), geometry.payload_length)
        except FormatError as exc:
            raise ValueError(exc.reason) from None
        stored_length = len(payload)
    elif len(payload) != geometry.payload_length:
        raise ValueError(f"payload is {len(payload)} bytes, geometry says {geometry.payload_length}")
    return BlockHeader(namespace=namespace, key=key, geometry=geometry,
                       payload_checksum=payload_checksum(payload),
                       created_ns=time.time_ns() if created_ns is None else created_ns, key_id=key_id,
                       codec=codec, stored_length=stored_length)


def encode_header(header: BlockHeader, out: memoryview | bytearray | None = None) -> bytes | None:
    """Serialise ``header`` into 4096 bytes; into ``out`` (zero-filled first) when given."""
    if len(header.namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace fingerprint must be {NAMESPACE_BYTES} bytes")
    if not 1 <= len(header.key) <= MAX_KEY_BYTES:
        raise ValueError(f"block key must be 1..{MAX_KEY_BYTES} bytes, got {len(header.key)}")
    if header.key_id and (not valid_key_id(header.key_id) or len(header.mac) not in (0, MAC_BYTES)):
        raise ValueError("key id must be 1..16 letters, digits, '.', '_' or '-' and the MAC 32 bytes")
    if header.coded != (header.stored_length is not None):
        raise ValueError("a coded header needs its stored length, an uncoded one has none")
    params = encode_params(header.codec) if header.coded else b""
    g = header.geometry
    body = _BODY.pack(MAGIC, header.version, HEADER_SIZE, 0, header.namespace, len(header.key),
                      header.key, header.payload_length, g.tokens, g.segments, g.segment_bytes,
                      header.payload_checksum, header.created_ns)
    checksum = _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body + params))
    trailer = b""
    if header.key_id:
        trailer = header.key_id.ljust(KEY_ID_BYTES, b"\0") + (header.mac or bytes(MAC_BYTES))
    elif params:
        trailer = bytes(CODEC_FIELD.start - _TRAILER)
    head = body + checksum + trailer + params
    if out is None:
        return head + bytes(HEADER_SIZE - len(head))
    view = memoryview(out).cast("B")[:HEADER_SIZE]
    view[:] = bytes(HEADER_SIZE)
    view[:len(head)] = head
    return None


def decode_header(data: memoryview | bytes, *, path: object = "<buffer>") -> BlockHeader:
    """Parse and check a header (``data``: a file's first 4096 bytes, all it has if fewer); raise
    ``FormatError``/``ChecksumError`` naming ``path``, ``TruncatedError`` for a file cut inside it."""
    if len(data) < HEADER_SIZE:
        raise _short_header(bytes(data), path)
    head = bytes(data[:CODEC_FIELD.stop])
    (magic, version, header_size, flags, namespace, key_length, key, payload_length, tokens,
     segments, segment_bytes, checksum, created_ns) = _BODY.unpack_from(head)
    if magic != MAGIC:
        raise FormatError(path, "bad magic: not a pykv block file")
    if not _checksum_matches(head, version):
        raise ChecksumError(path, "header checksum mismatch")
    if version not in VERSIONS:
        raise FormatError(path, f"unsupported format version {version} (this pykv reads "
                                f"{', '.join(map(str, VERSIONS))})")
    if header_size != HEADER_SIZE or flags != 0:
        raise FormatError(path, f"unsupported header size {header_size} or flags {flags:#x}")
    if not 1 <= key_length <= MAX_KEY_BYTES or any(key[key_length:]):
        raise FormatError(path, f"bad block key length {key_length}")
    codec, stored_length, zero_from = NONE, None, _TRAILER
    if version in (CODED_VERSION, SIGNED_CODED_VERSION):
        codec, stored_length, zero_from = decode_params(head[CODEC_FIELD], path=path), payload_length, CODEC_FIELD.stop
        check_stored(path, codec, payload_length, segments * segment_bytes)
    elif payload_length != segments * segment_bytes:
        raise FormatError(path, f"payload length {payload_length} != {segments} x {segment_bytes}")
    key_id, mac = b"", b""
    if version in (SIGNED_VERSION, SIGNED_CODED_VERSION):
        key_id, zero_from = head[KEY_ID_FIELD].rstrip(b"\0"), max(zero_from, MAC_FIELD.stop)
        mac = head[MAC_FIELD]
        if not valid_key_id(key_id):  # a zero inside the id is not one of its characters
            raise FormatError(path, "bad key id in a signed header")
    elif version == CODED_VERSION and any(head[_TRAILER:CODEC_FIELD.start]):
        raise FormatError(path, "reserved header bytes are not zero")
    if any(head[_RESERVED]) or bytes(data[zero_from:HEADER_SIZE]) != _ZERO_HEADER[zero_from:]:
        raise FormatError(path, "reserved header bytes are not zero")
    return BlockHeader(namespace=namespace, key=key[:key_length],
                       geometry=Geometry(tokens, segments, segment_bytes),
                       payload_checksum=checksum, created_ns=created_ns, key_id=key_id, mac=mac,
                       codec=codec, stored_length=stored_length)


def _checksum_matches(head: bytes, version: int) -> bool:
    """Whether the header checksum at 152 is that of bytes 0..151 (and a coded header's codec field)."""
    (stored_checksum,) = _CHECKSUM.unpack_from(head, _CHECKED_BYTES)
    covered = head[:_CHECKED_BYTES]
    if version in (CODED_VERSION, SIGNED_CODED_VERSION):
        covered += head[CODEC_FIELD]
    return stored_checksum == xxhash.xxh3_64_intdigest(covered)


def signed_parts(head: bytes | bytearray | memoryview) -> tuple[memoryview, ...]:
    """The bytes of an encoded header a signed block's MAC covers, in order, before its payload:
    0..175, and for a coded block (v4) its codec field 208..463 too (``pykv.auth``)."""
    view = memoryview(head)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if int.from_bytes(view[8:10], "little") == SIGNED_CODED_VERSION:
        return view[:SIGNED_BYTES], view[CODEC_FIELD]
    return (view[:SIGNED_BYTES],)


def _short_header(head: bytes, path: object) -> FormatError:
    """Why a file shorter than a header is damaged: truncated (with the size its header says, once
    the checked fields are there and their checksum matches), unless it is no pykv header at all."""
    if head[:len(MAGIC)] != MAGIC[:len(head)]:
        return FormatError(path, "bad magic: not a pykv block file")
    if len(head) < _TRAILER:
        return TruncatedError(path, len(head), None)
    version = _BODY.unpack_from(head)[1]
    if version in (CODED_VERSION, SIGNED_CODED_VERSION) and len(head) < CODEC_FIELD.stop:
        return TruncatedError(path, len(head), None)
    if not _checksum_matches(head, version):
        return ChecksumError(path, "header checksum mismatch")
    payload_length = _BODY.unpack_from(head)[7]
    return TruncatedError(path, len(head), file_size(payload_length))


def verify_payload(header: BlockHeader, payload: memoryview | bytes, *, path: object = "<buffer>") -> None:
    """Raise ``ChecksumError`` unless ``payload`` matches the header's xxh3-128."""
    if len(payload) < header.payload_length:
        raise TruncatedError(path, HEADER_SIZE + len(payload), header.file_size)
    if payload_checksum(memoryview(payload)[:header.payload_length]) != header.payload_checksum:
        raise ChecksumError(path, "payload checksum mismatch")
