"""``fp8``: lossy, opt-in; bf16/fp16 KV stored as float8 e4m3 with one float32 scale per
(vLLM block, layer, head, K or V).

A payload is a run of pages, one per vLLM block of one KV tensor (``docs/format.md``): with
vLLM 0.29+ (``LBHNC``) a page is ``[heads, tokens, 2 * head_dim]``, K's ``head_dim`` values
then V's for each token, i.e. axes ``H N K D`` (``PageShape.order``). Each page's K and V of
each head get their own scale ``amax / 448``, so one outlier token widens the scale of only
its head and page (4 bytes per ~4 KiB of fp8 with 16 tokens of 128 values).

Stored bytes: ``pages x heads x 2`` float32 scales (little endian, in that order), then one
e4m3 byte per value in the payload's own order. Their size is exact: anything else is refused.
``quantize`` and ``dequantize`` are torch functions that run on any device (decoding is meant
to happen on the GPU); ``Fp8Codec`` wraps them for byte buffers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from pykv.codec.base import Buffer, Codec, CodecError, byte_view

FORMAT_REVISION = 1
E4M3_MAX = 448.0
SCALE_BYTES = 4
_AXES = "HNKD"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PageShape:
    """What fp8 needs of the KV layout: one page's ``heads`` x ``tokens`` x K/V x ``head_dim``
    values of ``dtype``, laid out in ``order`` (a permutation of ``HNKD``, outermost first)."""

    heads: int
    tokens: int
    head_dim: int
    dtype: str = "bfloat16"
    order: str = "HNKD"

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(_AXES):
            raise ValueError(f"order must be a permutation of {_AXES}, not {self.order!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"fp8 encodes {' or '.join(_DTYPES)} KV, not {self.dtype}")
        if min(self.heads, self.tokens, self.head_dim) < 1:
            raise ValueError("heads, tokens and head_dim must be positive")

    @property
    def values(self) -> int:
        return self.heads * self.tokens * 2 * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.values * 2

    def dims(self) -> tuple[int, ...]:
        """The page's axis sizes in memory order."""
        size = {"H": self.heads, "N": self.tokens, "K": 2, "D": self.head_dim}
        return tuple(size[axis] for axis in self.order)

    def reduced(self) -> tuple[int, int]:
        """The axes (counted from 1, after the page axis) a scale spans: tokens and head_dim."""
        return 1 + self.order.index("N"), 1 + self.order.index("D")


def _scale_view(scales: torch.Tensor, page: PageShape) -> torch.Tensor:
    """Stored scales ``[pages, H, K]`` as a tensor that broadcasts over pages in memory order."""
    kept = [axis for axis in page.order if axis in "HK"]  # H and K in memory order
    shaped = scales if kept == ["H", "K"] else scales.transpose(1, 2)
    sizes = [scales.shape[0]] + [page.dims()[i] if axis in "HK" else 1 for i, axis in enumerate(page.order)]
    return shaped.reshape(sizes)


def quantize(values: torch.Tensor, page: PageShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes as uint8 in the payload's order, float32 scales ``[pages, H, 2]``) of
    ``values``: a flat bf16/fp16 tensor of whole pages. ``CodecError`` for non-finite values."""
    pages = values.numel() // page.values
    x = values.reshape(pages, *page.dims()).float()
    amax = x.abs().amax(dim=page.reduced(), keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        raise CodecError("fp8", "the payload holds NaN or infinite values")
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (x / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    stored = scale.squeeze(page.reduced())  # [pages, H, K] or [pages, K, H], as in memory
    if page.order.index("K") < page.order.index("H"):
        stored = stored.transpose(1, 2)
    return codes.view(torch.uint8).reshape(-1), stored.contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, page: PageShape, *,
               check: bool = True) -> torch.Tensor:
    """The payload's values (flat, ``page.dtype``) from uint8 e4m3 ``codes`` and float32
    ``scales [pages, H, 2]``, on their device. ``check``: refuse scales that are not finite,
    positive and small enough for the dtype, and NaN codes (a device sync)."""
    dtype = _DTYPES[page.dtype]
    pages = scales.shape[0]
    if check:
        limit = torch.finfo(dtype).max / E4M3_MAX
        if not bool(((scales > 0) & (scales <= limit)).all()):  # NaN compares False
            raise CodecError("fp8", "a scale is not a finite positive number the dtype can hold")
        if bool(((codes & 0x7F) == 0x7F).any()):
            raise CodecError("fp8", "NaN codes (the encoder writes none)")
    x = codes.view(torch.float8_e4m3fn).reshape(pages, *page.dims()).float()
    return (x * _scale_view(scales, page)).to(dtype).reshape(-1)


class Fp8Codec(Codec):
    """Lossy e4m3 codec for whole pages of ``page``; stored size = values + 8 bytes per page
    and head."""

    name = "fp8"

    def __init__(self, page: PageShape) -> None:
        self.page = page

    @property
    def params(self) -> str:
        p = self.page
        return (f"fp8:v{FORMAT_REVISION},e4m3,scale=block-layer-head-kv,dtype={p.dtype},heads={p.heads},"
                f"tokens={p.tokens},head_dim={p.head_dim},order={p.order}")

    def _pages(self, payload_len: int) -> int:
        if payload_len % self.page.page_bytes:
            raise CodecError(self.name, f"a payload of {payload_len} bytes is not whole pages of "
                                        f"{self.page.page_bytes} bytes")
        return payload_len // self.page.page_bytes

    def scale_bytes(self, payload_len: int) -> int:
        return self._pages(payload_len) * self.page.heads * 2 * SCALE_BYTES

    def encoded_bound(self, payload_len: int) -> int:
        return self.scale_bytes(payload_len) + payload_len // 2

    def encode(self, src: Buffer, out: Buffer | None = None) -> bytes | int:
        payload = byte_view(src)
        head = self.scale_bytes(len(payload))
        values = _tensor(payload).view(_DTYPES[self.page.dtype])
        codes, scales = quantize(values, self.page)
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
        expected = self.encoded_bound(len(target))
        if len(stored) != expected:
            raise CodecError(self.name, f"{len(stored)} stored bytes, a payload of {len(target)} "
                                        f"stores {expected}")
        if not len(target):
            return
        decode_tensor(_tensor(stored), _tensor(target), self.page)


def _tensor(view: memoryview) -> torch.Tensor:
    """A uint8 CPU tensor over ``view``'s memory (read-only buffers are only read)."""
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": we do not write it
        return torch.frombuffer(view, dtype=torch.uint8)


def decode_tensor(stored: torch.Tensor, out: torch.Tensor, page: PageShape, *, check: bool = True) -> None:
    """Decode uint8 ``stored`` into uint8 ``out`` (the payload's bytes), both on one device
    (CPU or GPU), sizes already checked by the caller (``Fp8Codec.decode`` does)."""
    head = out.numel() // page.page_bytes * page.heads * 2 * SCALE_BYTES
    scales = stored[:head].view(torch.float32).reshape(-1, page.heads, 2)
    out.view(_DTYPES[page.dtype]).copy_(dequantize(stored[head:], scales, page, check=check))
