"""The engine's codec (``kv_connector_extra_config.codec``), alike in the scheduler and the workers,
so both name the same namespace (``layout.namespace_for``)."""

from __future__ import annotations

from pykv.codec import Codec, codec_for
from pykv.config import PREFIX, PykvConfig
from pykv.errors import InputError

WIRED = ("none", "planes-zstd")
"""Codecs an engine can store with today; ``fp8`` needs the KV page shape from the connector (not yet)."""


def engine_codec(pykv: PykvConfig) -> Codec:
    """The codec this engine stores with (one codec object per process; its threads only change speed)."""
    if pykv.codec not in WIRED:
        raise InputError(f"{PREFIX}.codec: {pykv.codec!r} is not available in the engine yet "
                         f"(available: {', '.join(WIRED)}; see docs/codecs.md)")
    return codec_for(pykv.codec)
