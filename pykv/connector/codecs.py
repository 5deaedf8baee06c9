"""The engine's codec (``kv_connector_extra_config.codec``), alike in the scheduler and the workers,
so both name the same namespace (``layout.namespace_for``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from pykv.codec import Codec, codec_for
from pykv.codec.stage import CodecStage
from pykv.config import PREFIX, PykvConfig
from pykv.errors import InputError

if TYPE_CHECKING:
    from pykv.connector.copier import TorchCopier
    from pykv.connector.device_codec import DeviceCodec

log = logging.getLogger(__name__)
FP8_CODECS = ("fp8", "fp8-zstd")


def engine_codec(pykv: PykvConfig, kv_dtype: object = "bfloat16") -> Codec:
    """The codec this engine stores with (one codec object per process; its threads only change
    speed). ``kv_dtype``: the KV cache's dtype as vLLM names it (``OffloadingConfig.model.dtype``);
    ``fp8`` encodes bfloat16 and float16 KV only (``InputError`` for any other)."""
    if pykv.codec not in FP8_CODECS:
        return codec_for(pykv.codec, chunk=pykv.codec_chunk)
    from pykv.codec.fp8 import kv_dtype_name
    dtype = kv_dtype_name(kv_dtype)
    if dtype is None:
        raise InputError(f"{PREFIX}.codec: {pykv.codec} encodes bfloat16 or float16 KV; this engine's KV cache "
                         f"is {kv_dtype} (see docs/codecs.md)")
    return codec_for(pykv.codec, dtype=dtype, chunk=pykv.codec_chunk)


def device_codec_for(codec: Codec, pykv: PykvConfig, copier: TorchCopier, payload_lengths: list[int]) -> DeviceCodec | None:
    """The worker's device codec: ``fp8`` and ``fp8-zstd`` always (``fp8-zstd``'s frames decoded by
    nvCOMP as ``codec_decode`` says, else on the host); ``planes-zstd`` loads on the GPU as
    ``codec_decode`` says (``auto``: where nvCOMP loads and passes its start check, else the codec
    threads, said in one log line); None where the codec threads (or no codec) do the work."""
    if codec.name == "fp8":
        from pykv.connector.device_codec import DeviceFp8
        return DeviceFp8(codec, copier, payload_lengths, graphs=pykv.codec_graphs, step_blocks=pykv.codec_step_blocks)
    if codec.name == "fp8-zstd":
        return _fp8_zstd(codec, pykv, copier, payload_lengths)
    if codec.name != "planes-zstd":
        return None
    from pykv.connector.device_zstd import DevicePlanesZstd
    return _on_gpu(lambda **guards: DevicePlanesZstd(codec, copier, max(payload_lengths),
                                                     step_blocks=pykv.codec_step_blocks, **guards), pykv,
                   copier, "planes-zstd loads decode on the codec threads")


def _fp8_zstd(codec: Codec, pykv: PykvConfig, copier: TorchCopier, payload_lengths: list[int]) -> DeviceCodec:
    """``fp8-zstd`` on the KV's device, its frames decoded by nvCOMP as ``_on_gpu`` allows, else by
    the codec threads."""
    from pykv.connector.device_fp8_zstd import DeviceFp8HostZstd, DeviceFp8Zstd
    step_blocks = pykv.codec_step_blocks
    return (_on_gpu(lambda **guards: DeviceFp8Zstd(codec, copier, payload_lengths, step_blocks=step_blocks, **guards),
                    pykv, copier, "fp8-zstd frames decode on the codec threads")
            or DeviceFp8HostZstd(codec, copier, payload_lengths, step_blocks=step_blocks))


def _on_gpu(build: Callable[..., DeviceCodec], pykv: PykvConfig, copier: TorchCopier,
            fallback: str) -> DeviceCodec | None:
    """``build(checked=, authenticated=)`` (how the stored bytes are guarded before decoding: a
    checksum or MAC, a MAC), an nvCOMP decoder, once it passes its start check, where ``codec_decode``
    allows (``auto``, ``gpu``) and the KV is on a GPU; else None (``auto``: ``fallback`` said in one
    log line). ``codec_decode=gpu`` that cannot be kept is an ``InputError``."""
    if pykv.codec_decode == "cpu":
        return None
    if copier.tensors[0].device.type != "cuda":
        if pykv.codec_decode == "gpu":
            raise InputError(f"{PREFIX}.codec_decode: gpu, but this engine's KV cache is not on a GPU")
        return None
    device = None
    try:
        device = build(checked=_checked(pykv), authenticated=pykv.auth_key_file is not None)
        device.self_test()
        return device
    except InputError as exc:
        if device is not None:
            device.close()
        if pykv.codec_decode == "gpu":
            raise
        log.info("pykv: %s (%s)", fallback, exc)
        return None


def _checked(pykv: PykvConfig) -> bool:
    """Whether a load's stored bytes are checked (checksum or MAC) before they are decoded."""
    return pykv.verify == "full" or pykv.auth_key_file is not None


def codec_stage_for(codec: Codec, device: DeviceCodec | None, pykv: PykvConfig, slot_bytes: int,
                    register=None, unregister=None) -> CodecStage | None:
    """The codec threads, for what the device codec does not do (``planes-zstd``: stores, and loads
    unless on the GPU; ``fp8-zstd``: the zstd layer of stores); None where there is nothing."""
    if codec.name == "none" or (device is not None and device.encodes and not device.host_layer):
        return None
    layer = device.layer if device is not None and device.host_layer else codec
    return CodecStage(layer, slot_bytes, threads=pykv.codec_worker_threads(), register=register,
                      unregister=unregister)


def where_decoded(codec: Codec, device: DeviceCodec | None) -> str:
    """For the worker's start line: where this engine's coded blocks are decoded ("" for ``none``)."""
    if codec.name == "none":
        return ""
    if device is None:
        return ", decoded on the codec threads"
    return f", decoded by {type(device).__name__} ({device.step_blocks} blocks per device step)"
