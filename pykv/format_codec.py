"""The codec fields of a coded block's header (versions 3 and 4 of ``pykv.format``).

A coded block stores its payload as a codec (``pykv.codec``) wrote it: the header names the
codec by its ``params`` string (visible ASCII, at most 256 bytes, zero padded at 208..463)
and the payload length at 104 counts the stored bytes, while the raw (decoded) length stays
``segments x segment_bytes``. Both come from the file, so both are checked as hostile input:
the stored length may not exceed what the named codec can write for that raw length
(``stored_bound``), and nothing is ever allocated from either. Codec ``none`` is never coded:
its blocks are versions 1 and 2, byte for byte what pykv wrote before codecs.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from pykv.codec.base import Buffer, Codec, CodecError, byte_view
from pykv.errors import FormatError, PykvError

if TYPE_CHECKING:
    from pykv.format import BlockHeader

NONE = "none"
"""The identity codec's ``params``: blocks stored as they are (header versions 1 and 2)."""
PARAMS_BYTES = 256
PARAMS_CHARS = frozenset(range(0x21, 0x7F))
"""Visible ASCII: no spaces, controls or zeros (the padding) inside a codec's ``params``."""
MAX_RAW_PAYLOAD = 1 << 36
"""The largest raw payload a coded header may claim (64 GiB, above the 16 GiB a block file may
hold): a codec's bound is computed for the raw length, which must not take unbounded work."""


def valid_params(params: str | bytes) -> bool:
    """1..256 visible ASCII characters, and not ``none`` (which is never a coded block's)."""
    if isinstance(params, str) and not params.isascii():
        return False
    raw = params.encode("ascii") if isinstance(params, str) else params
    return 1 <= len(raw) <= PARAMS_BYTES and all(c in PARAMS_CHARS for c in raw) and raw != NONE.encode()


def encode_params(params: str) -> bytes:
    """The 256-byte field holding ``params``; ``ValueError`` unless ``valid_params``."""
    if not valid_params(params):
        raise ValueError(f"codec params must be 1..{PARAMS_BYTES} visible ASCII characters other than "
                         f"{NONE!r}, got {params[:80]!r}")
    return params.encode("ascii").ljust(PARAMS_BYTES, b"\0")


def decode_params(field: bytes, *, path: object) -> str:
    """The ``params`` in a header's field; ``FormatError`` unless visible ASCII then zeros only."""
    params = field.rstrip(b"\0")
    if not valid_params(params):  # a zero inside the string is not one of its characters
        raise FormatError(path, "bad codec params in a coded header")
    return params.decode("ascii")


def unknown_bound(raw: int) -> int:
    """The most stored bytes accepted for a codec this pykv does not know: the raw length plus
    1/64 and 64 KiB (a lossless coder's worst case is a few bytes per KiB)."""
    return raw + raw // 64 + (64 << 10)


def stored_bound(params: str, raw: int) -> int:
    """The most bytes the codec ``params`` stores for ``raw`` payload bytes: its ``encoded_bound``
    for a codec this pykv can build from its params, else ``unknown_bound``. ``CodecError`` for a
    raw length the codec cannot encode (an fp8 payload that is not whole groups)."""
    codec = codec_from_params(params)
    return unknown_bound(raw) if codec is None else codec.encoded_bound(raw)


def check_stored(path: object, params: str, stored: int, raw: int) -> None:
    """``FormatError`` unless a coded header's lengths are possible: a raw length up to
    ``MAX_RAW_PAYLOAD`` and a stored length within the codec's bound for it."""
    if raw > MAX_RAW_PAYLOAD:
        raise FormatError(path, f"coded payload of {raw} bytes exceeds {MAX_RAW_PAYLOAD}")
    try:
        bound = stored_bound(params, raw)
    except CodecError as exc:
        raise FormatError(path, f"raw payload of {raw} bytes: {exc}") from None
    if stored > bound:
        raise FormatError(path, f"stored payload of {stored} bytes exceeds the {bound} that {params.split(':')[0]} "
                                f"stores for {raw}")


@lru_cache(maxsize=16)
def codec_from_params(params: str) -> Codec | None:
    """The codec whose ``params`` are exactly ``params``, if this pykv can build it (``planes-zstd``
    and ``fp8-zstd`` of any chunk ``codec_chunk`` allows, ``fp8`` and ``fp8-zstd`` of any dtype
    and group they encode, when torch is installed); else None."""
    from pykv.codec.registry import chunk_allowed, codec_for
    name, _, settings = params.partition(":")
    if name not in ("planes-zstd", "fp8", "fp8-zstd"):
        return None
    fields = dict(item.partition("=")[::2] for item in settings.split(","))
    try:
        chunk = int(fields["chunk"]) if "chunk" in fields and len(fields["chunk"]) <= 12 else None
        if chunk is not None and not chunk_allowed(chunk):
            chunk = None  # a chunk pykv never writes: the default's params cannot match it
        if name == "planes-zstd":
            codec = codec_for(name, chunk=chunk)
        else:
            codec = codec_for(name, dtype=fields["dtype"], group=int(fields["group"]), chunk=chunk)
    except (ImportError, KeyError, ValueError, PykvError):
        return None
    return codec if codec.params == params else None


def decode_payload(header: BlockHeader, stored: Buffer, dst: Buffer, codec: Codec, *, path: object = "<buffer>") -> None:
    """Restore a checked block's payload into ``dst`` (the reader's buffer of its own geometry's
    length) with ``codec``, the reader's: ``FormatError`` if the block names another codec or
    another raw length, ``CodecError`` if its stored bytes do not decode."""
    if header.codec != codec.params:
        raise FormatError(path, f"block stored with codec {header.codec}, this engine's is {codec.params}")
    target = byte_view(dst, writable=True)
    if len(target) != header.raw_length:
        raise FormatError(path, f"payload of {header.raw_length} bytes, expected {len(target)}")
    codec.decode(byte_view(stored)[:header.payload_length], target)
