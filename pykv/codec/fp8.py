"""``fp8``: lossy, opt-in; bf16/fp16 KV stored as float8 e4m3 with one power-of-two scale per
group of ``group`` consecutive values (64 by default).

Every KV layout vLLM uses (cross-layer pages included) keeps one token's ``head_dim`` values
of one head's K or V contiguous, innermost. A group of 64 consecutive values therefore lies
within one head's K or V of one token for ``head_dim`` 64, 128 or 256: the scale is per
token, head and K/V, and the codec needs no knowledge of the layout. One outlier widens the
scale of its group only.

The scale is the smallest power of two ``2**k`` that brings the group's largest magnitude to
at most 448 (e4m3's largest), stored as one byte ``k + 127`` (OCP's E8M0). Scaling by a power
of two is exact, so the GPU and the CPU write the same bytes for the same KV (a float32 scale
``amax / 448`` rounds differently on CUDA); e4m3's relative precision is the same in every
binade, so only values near the bottom of a group's range lose to it.

Stored bytes: ``values / group`` scale bytes (in payload order), then one e4m3 byte per value
in the payload's order. Their size is exact (``stored_length``): anything else is refused.
``quantize`` and ``dequantize`` are torch functions that run on any device and report bad input
as a flag tensor, so a GPU caller reads it when the work is done instead of waiting for it
(``pykv.connector.device_codec``); ``Fp8Codec`` wraps them for byte buffers (tools, tests,
``pykv bench``).
"""

from __future__ import annotations

import math
import warnings

import torch

from pykv.codec.base import Buffer, Codec, CodecError, byte_view

FORMAT_REVISION = 2
E4M3_MAX = 448.0
SCALE_BYTES = 1
SCALE_BIAS = 127
MIN_EXPONENT, MAX_EXPONENT = -126, 126  # 2**k and 2**-k are both normal float32 numbers
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


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` as float32, exactly (built from its bits; exponents within
    ``MIN_EXPONENT..MAX_EXPONENT``)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def max_exponent(dtype: torch.dtype) -> int:
    """The largest scale exponent whose 448 x 2**k the dtype holds (bf16: 119, fp16: 7)."""
    return int(math.floor(math.log2(torch.finfo(dtype).max / E4M3_MAX)))


def quantize(values: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes as uint8 in the payload's order, scale bytes ``k + 127`` one per group, a 0-d
    bool tensor: True if a value is NaN or infinite, or so large that its group's scale is beyond
    what ``dequantize`` accepts for the dtype) of ``values``, a flat bf16/fp16 tensor of whole
    groups, all on ``values``' device. Nothing waits for the device."""
    x = values.reshape(-1, group).float()
    amax = x.abs().amax(dim=1, keepdim=True)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    k = exponent - 9 + (mantissa > E4M3_MAX / 512).to(exponent.dtype)
    # a scale the decoder would refuse (448 x 2**k beyond the dtype: fp16 above 57,344) is refused here
    bad = ~torch.isfinite(amax).all() | (k > max_exponent(values.dtype)).any()
    k = k.clamp_(MIN_EXPONENT, MAX_EXPONENT)
    codes = x.mul_(_power_of_two(-k)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).reshape(-1), (k + SCALE_BIAS).to(torch.uint8).reshape(-1), bad


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, group: int) -> torch.Tensor:
    """Write the values of uint8 e4m3 ``codes`` and scale bytes ``scales`` into ``out`` (flat,
    bf16/fp16, ``codes.numel()`` values) on their device. Returns a 0-d bool tensor: True if a
    scale is outside ``MIN_EXPONENT..`` the dtype's ``max_exponent``, or a code is NaN (the
    encoder writes neither). Nothing waits for the device."""
    return dequantize_rows(codes.reshape(1, -1), scales.reshape(1, -1), out.reshape(1, -1), group)[0]


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, group: int) -> torch.Tensor:
    """``dequantize`` of each row of 2-d ``codes``, ``scales`` and ``out`` (one block per row) in
    one pass; returns a bool tensor of one flag per row. bf16 is decoded in place in ``out``
    (e4m3 and ``2**k`` are exact in bf16 and the product is rounded once, as through float32);
    fp16, whose range lacks the small scales, through a float32 temporary."""
    rows = codes.shape[0]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    bad = ~((exponent >= MIN_EXPONENT) & (exponent <= max_exponent(out.dtype))).all(dim=1)
    bad |= ((codes & 0x7F) == 0x7F).any(dim=1)
    scale = _power_of_two(exponent.clamp(MIN_EXPONENT, MAX_EXPONENT)).reshape(rows, -1, 1)
    values = codes.view(torch.float8_e4m3fn).reshape(rows, -1, group)
    target = out.view(rows, -1, group)
    if out.dtype == torch.bfloat16:
        target.copy_(values)
        target.mul_(scale.to(torch.bfloat16))
    else:
        target.copy_(values.float().mul_(scale))
    return bad


class Fp8Codec(Codec):
    """Lossy e4m3 codec for payloads of ``dtype`` values in whole groups of ``group``; stored
    size = one byte per value + one per group."""

    name = "fp8"

    def __init__(self, dtype: str = "bfloat16", group: int = DEFAULT_GROUP) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"fp8 encodes {' or '.join(DTYPES)} KV, not {dtype}")
        if not 1 <= group <= MAX_GROUP:
            raise ValueError(f"fp8 group must be 1..{MAX_GROUP} values, not {group}")
        self.dtype, self.group = dtype, group

    @property
    def params(self) -> str:
        return f"fp8:v{FORMAT_REVISION},e4m3,group={self.group},scale=e8m0,dtype={self.dtype}"

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
            raise CodecError(self.name, "the payload holds NaN or infinite values, or values beyond 448 x 2**k for its dtype")
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
            raise CodecError(self.name, "a scale the dtype cannot hold, or a NaN code (the encoder writes neither)")


def _tensor(view: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor over ``view``'s memory (read-only buffers are only read)."""
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we do not write it
        return torch.frombuffer(view, dtype=torch.uint8)


def decode_rows(stored: torch.Tensor, out: torch.Tensor, codec: Fp8Codec) -> torch.Tensor:
    """``decode_tensor`` of each row of 2-d uint8 ``stored`` into the same row of 2-d uint8
    ``out`` (one block per row, all of one length); one bad-input flag per row."""
    head = codec.scale_bytes(out.shape[1])
    return dequantize_rows(stored[:, head:], stored[:, :head], out.view(codec.torch_dtype), codec.group)


def decode_tensor(stored: torch.Tensor, out: torch.Tensor, codec: Fp8Codec) -> torch.Tensor:
    """Decode uint8 ``stored`` into uint8 ``out`` (the payload's bytes), both on one device,
    sizes already checked by the caller; returns ``dequantize``'s bad-input flag."""
    head = codec.scale_bytes(out.numel())
    return dequantize(stored[head:], stored[:head], out.view(codec.torch_dtype), codec.group)
