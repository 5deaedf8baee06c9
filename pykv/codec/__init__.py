"""Block codecs: how a storage block's payload is stored (``none``, lossless ``planes-zstd``,
lossy opt-in ``fp8``). Pure functions of bytes; the reactor and format integrate them.
See docs/codecs.md."""

from pykv.codec.base import Codec, CodecError, UnknownCodecError
from pykv.codec.registry import CHUNK_BOUNDS, CODEC_NAMES, chunk_allowed, codec_for

__all__ = ["CHUNK_BOUNDS", "CODEC_NAMES", "Codec", "CodecError", "UnknownCodecError", "chunk_allowed", "codec_for"]
