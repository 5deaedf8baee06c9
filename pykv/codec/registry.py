"""The one place a codec is chosen by its configuration name."""

from __future__ import annotations

from pykv.codec.base import Codec, UnknownCodecError
from pykv.codec.identity import IdentityCodec

CODEC_NAMES = ("none", "planes-zstd", "fp8")
"""Configuration names, in the order docs/codecs.md describes them."""


def codec_for(name: str, *, page: object = None, threads: int = 1) -> Codec:
    """The codec configured as ``name``. ``page`` (a ``pykv.codec.fp8.PageShape``) is what the
    lossy ``fp8`` codec needs to know of the KV layout; ``threads`` only changes speed.
    Raise ``UnknownCodecError`` (one line) for any other name or a missing ``page``."""
    if name == "none":
        return IdentityCodec()
    if name == "planes-zstd":
        from pykv.codec.lossless import PlanesZstdCodec
        return PlanesZstdCodec(threads=threads)
    if name == "fp8":
        from pykv.codec.fp8 import Fp8Codec, PageShape
        if not isinstance(page, PageShape):
            raise UnknownCodecError("codec 'fp8' needs the KV page shape (heads, tokens, head_dim, "
                                    "dtype, order) of the engine")
        return Fp8Codec(page)
    raise UnknownCodecError(f"unknown codec {name!r} (known: {', '.join(CODEC_NAMES)})")
