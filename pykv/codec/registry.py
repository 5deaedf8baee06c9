"""The one place a codec is chosen by its configuration name."""

from __future__ import annotations

from pykv.codec.base import Codec, UnknownCodecError
from pykv.codec.identity import IdentityCodec

CODEC_NAMES = ("none", "planes-zstd", "fp8", "fp8-zstd")
"""Configuration names, in the order docs/codecs.md describes them."""
CHUNK_BOUNDS = (16 << 10, 64 << 20, 4 << 10)
"""The zstd codecs' chunks pykv writes (``codec_chunk``): the least and most bytes, and the
multiple a chunk must be."""


def chunk_allowed(chunk: int) -> bool:
    """Whether ``chunk`` bytes is a chunk ``codec_chunk`` allows."""
    least, most, multiple = CHUNK_BOUNDS
    return least <= chunk <= most and chunk % multiple == 0


def codec_for(name: str, *, dtype: str = "bfloat16", group: int | None = None, threads: int = 1,
              chunk: int | None = None) -> Codec:
    """The codec configured as ``name``. ``dtype`` (``bfloat16`` or ``float16``) and ``group``
    are what the lossy ``fp8`` codecs need to know of the KV; ``chunk``: the zstd codecs' bytes
    per chunk (None: their own default); ``threads`` only changes speed. Raise
    ``UnknownCodecError`` (one line) for any other name, or a dtype fp8 does not encode."""
    sized = {} if chunk is None else {"chunk": chunk}
    if name == "none":
        return IdentityCodec()
    if name == "planes-zstd":
        from pykv.codec.lossless import PlanesZstdCodec
        return PlanesZstdCodec(threads=threads, **sized)
    if name == "fp8":
        from pykv.codec.fp8 import DEFAULT_GROUP, Fp8Codec
        try:
            return Fp8Codec(dtype, DEFAULT_GROUP if group is None else group)
        except ValueError as exc:
            raise UnknownCodecError(f"codec 'fp8': {exc}") from None
    if name == "fp8-zstd":
        from pykv.codec.fp8 import DEFAULT_GROUP
        from pykv.codec.fp8_zstd import Fp8ZstdCodec
        try:
            return Fp8ZstdCodec(dtype, DEFAULT_GROUP if group is None else group, threads=threads, **sized)
        except ValueError as exc:
            raise UnknownCodecError(f"codec 'fp8-zstd': {exc}") from None
    raise UnknownCodecError(f"unknown codec {name!r} (known: {', '.join(CODEC_NAMES)})")
