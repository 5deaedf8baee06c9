"""``pykv/codec/fp8_zstd.py``: fp8's stored bytes zstd-coded; the same KV back as ``fp8`` from fewer
bytes, and stored bytes that do not decode to exactly fp8's bytes of the trusted length refused
with ``CodecError`` (never another exception, never wrong KV)."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from pykv.codec import CodecError, codec_for
from pykv.codec.fp8 import Fp8Codec
from pykv.codec.fp8_zstd import Fp8ZstdCodec
from pykv.errors import FormatError
from pykv.format_codec import check_stored, codec_from_params
from tests.test_codec_lossless import bf16_bytes, kv_like

FP8 = Fp8Codec()
CODEC = Fp8ZstdCodec(chunk=1 << 16)  # several chunks for a small payload


def payload() -> bytes:
    return bf16_bytes(kv_like(64))  # 64 pages of bf16 KV-like values


def test_the_kv_back_is_fp8s_from_fewer_bytes():
    raw = payload()
    stored = CODEC.encode(raw)
    assert CODEC.decode_bytes(stored, len(raw)) == FP8.decode_bytes(FP8.encode(raw), len(raw))
    assert len(stored) < 0.9 * FP8.stored_length(len(raw))
    assert len(stored) <= CODEC.encoded_bound(len(raw))
    out = bytearray(CODEC.encoded_bound(len(raw)))
    assert CODEC.encode(raw, out) == len(stored) and bytes(out[:len(stored)]) == stored


def test_the_zstd_layer_holds_exactly_fp8s_bytes():
    raw = payload()
    inner = CODEC.frames.decode_bytes(CODEC.encode(raw), CODEC.inner_length(len(raw)))
    assert inner == FP8.encode(raw)


def test_incompressible_fp8_bytes_stay_within_the_bound():
    codec = Fp8ZstdCodec(chunk=4096)
    generator = torch.Generator().manual_seed(1)
    values = (torch.rand(8192, generator=generator) * 2 - 1).to(torch.bfloat16)  # codes close to random
    raw = values.view(torch.uint8).numpy().tobytes()
    stored = codec.encode(raw)
    assert len(stored) <= codec.encoded_bound(len(raw))
    assert codec.decode_bytes(stored, len(raw)) == FP8.decode_bytes(FP8.encode(raw), len(raw))


def test_params_differ_from_fp8s_and_build_the_codec_back():
    assert CODEC.params.startswith("fp8-zstd:v1,") and CODEC.params != FP8.params
    for dtype in ("bfloat16", "float16"):
        codec = codec_for("fp8-zstd", dtype=dtype)
        assert codec_from_params(codec.params).params == codec.params
    assert codec_from_params(CODEC.params.replace("chunk=65536", "chunk=9")) is None  # not one pykv writes


def _table(stored: bytes, index: int, value: int) -> bytes:
    out = bytearray(stored)
    struct.pack_into("<I", out, 4 * index, value)
    return bytes(out)


@pytest.mark.parametrize("case", ["truncated", "trailing", "table-zero", "table-over", "frame-corrupt",
                                  "empty", "raw-length-other"])
def test_stored_bytes_that_do_not_decode_are_codec_errors(case):
    raw = payload()
    stored, length = CODEC.encode(raw), len(raw)
    if case == "truncated":
        stored = stored[:-5]
    elif case == "trailing":
        stored += b"\0"
    elif case == "table-zero":
        stored = _table(stored, 0, 0)
    elif case == "table-over":
        stored = _table(stored, 0, (1 << 16) + 1)
    elif case == "frame-corrupt":
        chunks = -(-CODEC.inner_length(length) // (1 << 16))
        at = 4 * chunks + 20
        stored = stored[:at] + bytes(b ^ 0xFF for b in stored[at:at + 8]) + stored[at + 8:]
    elif case == "empty":
        stored = b""
    elif case == "raw-length-other":
        length -= 128  # a header claiming another raw length: the inner length differs
    with pytest.raises(CodecError):
        CODEC.decode_bytes(stored, length)


def test_raw_lengths_that_are_not_whole_groups_are_refused():
    with pytest.raises(CodecError):
        CODEC.encoded_bound(100)
    with pytest.raises(CodecError):
        CODEC.decode_bytes(CODEC.encode(payload()), 100)


def test_inner_bytes_with_a_scale_the_dtype_cannot_hold_are_refused():
    raw = payload()
    inner = bytearray(FP8.encode(raw))
    inner[0] = 0xFF  # a scale byte fp8 never writes
    stored = CODEC.frames.encode(bytes(inner))
    with pytest.raises(CodecError):
        CODEC.decode_bytes(stored, len(raw))


def test_fuzzed_stored_bytes_decode_to_fp8s_kv_or_are_refused():
    raw = payload()
    stored = CODEC.encode(raw)
    expected = CODEC.decode_bytes(stored, len(raw))
    rng = random.Random(7)
    for _ in range(60):
        hostile = bytearray(stored)
        for _ in range(rng.randint(1, 4)):
            hostile[rng.randrange(len(hostile))] = rng.randrange(256)
        try:
            got = CODEC.decode_bytes(bytes(hostile), len(raw))
        except CodecError:
            continue
        # a flip the zstd layer cannot see (a raw chunk, a literal) gives other fp8 bytes: finite KV
        values = torch.frombuffer(bytearray(got), dtype=torch.bfloat16)
        assert torch.isfinite(values.float()).all() or got == expected


def test_a_header_claiming_more_stored_bytes_than_the_codec_writes_is_a_format_error():
    codec, raw = codec_for("fp8-zstd"), len(payload())
    check_stored("x.kv", codec.params, codec.encoded_bound(raw), raw)
    with pytest.raises(FormatError):
        check_stored("x.kv", codec.params, codec.encoded_bound(raw) + 1, raw)
    with pytest.raises(FormatError):
        check_stored("x.kv", codec.params, 10, raw - 2)  # a raw length fp8 cannot encode
