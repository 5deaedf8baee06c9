"""The engine's codec (``kv_connector_extra_config.codec``), alike in the scheduler and the workers,
so both name the same namespace (``layout.namespace_for``)."""

from __future__ import annotations

from pykv.codec import Codec, codec_for
from pykv.config import PREFIX, PykvConfig
from pykv.errors import InputError

DEVICE_CODECS = ("fp8",)
"""Codecs the workers run on the KV cache's device (``pykv.connector.device_codec``); the
others run on the codec threads (``pykv.codec.stage``)."""


def engine_codec(pykv: PykvConfig, kv_dtype: object = "bfloat16") -> Codec:
    """The codec this engine stores with (one codec object per process; its threads only change
    speed). ``kv_dtype``: the KV cache's dtype as vLLM names it (``OffloadingConfig.model.dtype``);
    ``fp8`` encodes bfloat16 and float16 KV only (``InputError`` for any other)."""
    if pykv.codec != "fp8":
        return codec_for(pykv.codec)
    from pykv.codec.fp8 import kv_dtype_name
    dtype = kv_dtype_name(kv_dtype)
    if dtype is None:
        raise InputError(f"{PREFIX}.codec: fp8 encodes bfloat16 or float16 KV; this engine's KV cache is "
                         f"{kv_dtype} (see docs/codecs.md)")
    return codec_for("fp8", dtype=dtype)
