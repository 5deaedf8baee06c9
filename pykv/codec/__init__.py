"""Block codecs: how a storage block's payload is stored (``none``, lossless ``planes-zstd``,
lossy opt-in ``fp8``). Pure functions of bytes; the reactor and format integrate them.
See docs/codecs.md."""

from pykv.codec.base import Codec, CodecError, UnknownCodecError
from pykv.codec.registry import CODEC_NAMES, codec_for

__all__ = ["CODEC_NAMES", "Codec", "CodecError", "UnknownCodecError", "codec_for"]
