"""The engine's codec (``kv_connector_extra_config.codec``), alike in the scheduler and the workers,
so both name the same namespace (``layout.namespace_for``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pykv.codec import Codec, codec_for
from pykv.config import PREFIX, PykvConfig
from pykv.errors import InputError

if TYPE_CHECKING:
    from pykv.connector.copier import TorchCopier
    from pykv.connector.device_codec import DeviceCodec

log = logging.getLogger(__name__)


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


def device_codec_for(codec: Codec, pykv: PykvConfig, copier: TorchCopier, payload_lengths: list[int]) -> DeviceCodec | None:
    """The worker's device codec: ``fp8`` always; ``planes-zstd`` loads on the GPU as
    ``codec_decode`` says (``auto``: where nvCOMP loads and passes its start check, else the codec
    threads, said in one log line); None where the codec threads (or no codec) do the work."""
    if codec.name == "fp8":
        from pykv.connector.device_codec import DeviceFp8
        return DeviceFp8(codec, copier, payload_lengths)
    if codec.name != "planes-zstd" or pykv.codec_decode == "cpu":
        return None
    if copier.tensors[0].device.type != "cuda":
        if pykv.codec_decode == "gpu":
            raise InputError(f"{PREFIX}.codec_decode: gpu, but this engine's KV cache is not on a GPU")
        return None
    from pykv.connector.device_zstd import DevicePlanesZstd
    device = None
    try:
        checked = pykv.verify == "full" or pykv.auth_key_file is not None  # the stored bytes checked first
        device = DevicePlanesZstd(codec, copier, max(payload_lengths), checked=checked)
        device.self_test()
    except InputError as exc:
        if device is not None:
            device.close()
        if pykv.codec_decode == "gpu":
            raise
        log.info("pykv: planes-zstd loads decode on the codec threads (%s)", exc)
        return None
    return device


def where_decoded(codec: Codec, device: DeviceCodec | None) -> str:
    """For the worker's start line: where this engine's coded blocks are decoded ("" for ``none``)."""
    if codec.name == "none":
        return ""
    if device is None:
        return ", decoded on the codec threads"
    return f", decoded by {type(device).__name__} ({device.step_blocks} blocks per device step)"
