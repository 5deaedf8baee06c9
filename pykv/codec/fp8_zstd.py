"""``fp8-zstd``: lossy, opt-in; ``fp8``'s stored bytes entropy-coded by zstd (about 0.83 of them).

e4m3 codes of KV cluster in a few binades like bf16 values do, so zstd saves a sixth of fp8's
bytes (~0.42 of the KV's instead of ~0.51): a load bound by its medium reads that much less.
The KV decoded is exactly what ``fp8`` decodes; only the stored bytes differ.

Stored bytes: ``fp8``'s stored bytes (scales, then codes; ``Fp8Codec.stored_length``) coded as
``planes-zstd`` codes one-byte values (``elem=1``: a table of chunk lengths, then each chunk a
zstd frame, or raw where that is not smaller), with every check of that format: the inner
length comes from the trusted payload length, never from the stored bytes. Engines encode the
fp8 step on the KV's device and the zstd layer on the codec threads, and decode frames on the
GPU with nvCOMP where it passes its start check (``pykv.connector.device_fp8_zstd``).
"""

from __future__ import annotations

import numpy as np

from pykv.codec.base import Buffer, Codec, byte_view, finish
from pykv.codec.fp8 import DEFAULT_GROUP, Fp8Codec
from pykv.codec.lossless import PlanesZstdCodec

FORMAT_REVISION = 1
CHUNK = 1 << 18
"""Bytes of fp8 per zstd frame: the ratio is the same from 64 KiB to 1 MiB (0.413 on dummy KV), and
nvCOMP decodes a step's frames in parallel, one frame per worker, so more frames keep more of the
GPU busy (a 3B storage block of 256 tokens: ~57 frames)."""


class Fp8ZstdCodec(Codec):
    """``fp8`` (``dtype``, ``group``) then zstd over its stored bytes in chunks of ``chunk``."""

    name = "fp8-zstd"

    def __init__(self, dtype: str = "bfloat16", group: int = DEFAULT_GROUP, *, level: int = 1,
                 chunk: int = CHUNK, threads: int = 1) -> None:
        self.fp8 = Fp8Codec(dtype, group)
        self.frames = PlanesZstdCodec(elem=1, level=level, chunk=chunk, threads=threads)
        self.dtype, self.group = dtype, group

    @property
    def params(self) -> str:
        return (f"{self.name}:v{FORMAT_REVISION},e4m3,group={self.group},scale=e8m0,dtype={self.dtype},"
                f"level={self.frames.level},chunk={self.frames.chunk}")

    def inner_length(self, payload_len: int) -> int:
        """The length of the fp8 bytes the zstd layer codes (``CodecError`` unless whole groups)."""
        return self.fp8.stored_length(payload_len)

    def encoded_bound(self, payload_len: int) -> int:
        return self.frames.encoded_bound(self.inner_length(payload_len))

    def encode(self, src: Buffer, out: Buffer | None = None) -> bytes | int:
        payload = byte_view(src)
        inner = self.fp8.encode(payload)
        assert isinstance(inner, bytes)
        stored = self.frames.encode(inner)
        assert isinstance(stored, bytes)
        return finish(self.name, memoryview(stored), out)

    def decode(self, src: Buffer, dst: Buffer) -> None:
        target = byte_view(dst, writable=True)
        inner = np.empty(self.inner_length(len(target)), dtype=np.uint8)  # from the trusted length
        self.frames.decode(src, inner)
        self.fp8.decode(memoryview(inner), target)

    def close(self) -> None:
        self.frames.close()
