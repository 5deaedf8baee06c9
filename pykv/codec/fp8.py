"""``fp8``: lossy, opt-in; bf16/fp16 KV stored as float8 e4m3 with one float32 scale per
group of ``group`` consecutive values (64 by default).

Every KV layout vLLM uses (cross-layer pages included) keeps one token's ``head_dim`` values
of one head's K or V contiguous, innermost. A group of 64 consecutive values therefore lies
within one head's K or V of one token for ``head_dim`` 64, 128 or 256: the scale is per
token, head and K/V, and the codec needs no knowledge of the layout. One outlier widens the
scale of its group only.

Stored bytes: ``values / group`` float32 scales (little endian, in payload order), then one
e4m3 byte per value in the payload's order. Their size is exact (``stored_length``):
anything else is refused. ``quantize`` and ``dequantize`` are torch functions that run on
any device and report bad input as a flag tensor, so a GPU caller reads it when the work is
done instead of waiting for it (``pykv.connector.device_codec``); ``Fp8Codec`` wraps them
for byte buffers (tools, tests, ``pykv bench``).
"""

from __future__ import annotations

import warnings

import torch

from pykv.codec.base import Buffer, Codec, CodecError, byte_view

FORMAT_REVISION = 2
E4M3_MAX = 448.0
SCALE_BYTES = 4
DEFAULT_GROUP = 64
MAX_GROUP = 4096
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
                "fp16": "float16"}


def kv_dtype_name(dtype: object) -> str | None:
    """``bfloat16`` or ``float16`` for a KV cache dtype fp8 encodes (a torch dtype or vLLM's
    name of it, e.g. ``torch.bfloat16`` or ``half``), else None."""
    name = str(dtype).removeprefix("torch.").lower()
    return _DTYPE_NAMES.get(name)


def quantize(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes as uint8 in the payload's order, float32 scales one per group, a 0-d bool
    tensor: True if a value is NaN or infinite) of ``values``, a flat bf16/fp16 tensor of
    whole groups, all on ``values``' device. Nothing waits for the device."""
    x = values.reshape(-1, group).float()
    amax = x.abs().amax(dim=1, keepdim=True)
    bad = ~torch.isfinite(amax).all()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = x.div_(scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).reshape(-1), scale.reshape(-1), bad


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, group: int) -> torch.Tensor:
    """Write the values of uint8 e4m3 ``codes`` and float32 ``scales`` into ``out`` (flat,
    bf16/fp16, ``codes.numel()`` values) on their device. Returns a 0-d bool tensor: True if a
    scale is not a finite positive number the dtype can hold, or a code is NaN (the encoder
    writes neither). Nothing waits for the device."""
    limit = torch.finfo(out.dtype).max / E4M3_MAX
    bad = ~((scales > 0) & (scales <= limit)).all()  # NaN compares False
    bad |= ((codes & 0x7F) == 0x7F).any()
    x = codes.view(torch.float8_e4m3fn).reshape(-1, group).float()
    out.view(-1, group).copy_(x.mul_(scales.reshape(-1, 1)))
    return bad


class Fp8Codec(Codec):
    """Lossy e4m3 codec for payloads of ``dtype`` values in whole groups of ``group``; stored
    size = one byte per value + 4 bytes per group."""

    name = "fp8"

    def __init__(self, dtype: str = "bfloat16", group: int = DEFAULT_GROUP) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"fp8 encodes {' or '.join(DTYPES)} KV, not {dtype}")
        if not 1 <= group <= MAX_GROUP:
            raise ValueError(f"fp8 group must be 1..{MAX_GROUP} values, not {group}")
        self.dtype, self.group = dtype, group

    @property
    def params(self) -> str:
        return f"fp8:v{FORMAT_REVISION},e4m3,group={self.group},scale=f32,dtype={self.dtype}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def groups(self, payload_len: int) -> int:
        """How many groups a payload of ``payload_len`` bytes holds; ``CodecError`` unless whole."""
        group_bytes = 2 * self.group
        if payload_len % group_bytes:
            raise CodecError(self.name, f"a payload of {payload_len} bytes is not whole groups of "
                                        f"{group_bytes} bytes")
        return payload_len // group_bytes

    def scale_bytes(self, payload_len: int) -> int:
        return self.groups(payload_len) * SCALE_BYTES

    def stored_length(self, payload_len: int) -> int:
        """The exact stored size of a payload of ``payload_len`` bytes."""
        return self.scale_bytes(payload_len) + payload_len // 2

    def encoded_bound(self, payload_len: int) -> int:
        return self.stored_length(payload_len)

    def encode(self, src: Buffer, out: Buffer | None = None) -> bytes | int:
        payload = byte_view(src)
        head = self.scale_bytes(len(payload))
        codes, scales, bad = quantize(_tensor(payload).view(self.torch_dtype), self.group)
        if bool(bad):
            raise CodecError(self.name, "the payload holds NaN or infinite values")
        total = head + codes.numel()
        target = bytearray(total) if out is None else byte_view(out, writable=True)
        if len(target) < total:
            raise CodecError(self.name, f"output buffer of {len(target)} bytes is smaller than the "
                                        f"{total} encoded bytes")
        view = memoryview(target)
        view[:head] = scales.numpy().tobytes()
        view[head:total] = codes.numpy()
        return bytes(target) if out is None else total

    def decode(self, src: Buffer, dst: Buffer) -> None:
        stored, target = byte_view(src), byte_view(dst, writable=True)
        expected = self.stored_length(len(target))
        if len(stored) != expected:
            raise CodecError(self.name, f"{len(stored)} stored bytes, a payload of {len(target)} "
                                        f"stores {expected}")
        if not len(target):
            return
        if bool(decode_tensor(_tensor(stored), _tensor(target), self)):
            raise CodecError(self.name, "a scale is not a finite positive number the dtype can hold, or a code is NaN")


def _tensor(view: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor over ``view``'s memory (read-only buffers are only read)."""
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we do not write it
        return torch.frombuffer(view, dtype=torch.uint8)


def decode_tensor(stored: torch.Tensor, out: torch.Tensor, codec: Fp8Codec) -> torch.Tensor:
    """Decode uint8 ``stored`` into uint8 ``out`` (the payload's bytes), both on one device,
    sizes already checked by the caller; returns ``dequantize``'s bad-input flag."""
    head = codec.scale_bytes(out.numel())
    return dequantize(stored[head:], stored[:head].view(torch.float32), out.view(codec.torch_dtype), codec.group)
