"""``pykv/codec/fp8.py``: e4m3 with one scale per (page, head, K/V), within e4m3's error, and
stored bytes that do not fit refused with ``CodecError``."""

from __future__ import annotations

import random

import pytest
import torch

from pykv.codec import CodecError
from pykv.codec.fp8 import (
    E4M3_MAX,
    Fp8Codec,
    PageShape,
    decode_tensor,
    dequantize,
    quantize,
)
from tests.test_codec_lossless import kv_like

PAGE = PageShape(heads=4, tokens=16, head_dim=64)
# e4m3 rounds to 3 mantissa bits (half an ulp: 2^-4 relative), the bf16 result to 8 (2^-9)
NORMAL_BOUND = 2 ** -4 + 2 ** -8


def payload_of(values: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bytes:
    return values.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()


def decoded(codec: Fp8Codec, stored: bytes, payload_len: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.frombuffer(bytearray(codec.decode_bytes(stored, payload_len)), dtype=dtype)


def errors(original: torch.Tensor, restored: torch.Tensor, scales: torch.Tensor) -> dict[str, float]:
    """Relative errors of K and V: max over values in e4m3's normal range of their scale, mean
    over non-zero values, and the norm of the error over the norm of the values."""
    x = original.float().reshape(-1, PAGE.heads, PAGE.tokens, 2, PAGE.head_dim)
    y = restored.float().reshape(x.shape)
    floor = scales[:, :, None, :, None] * 2 ** -6  # smallest normal e4m3 value, scaled
    out = {}
    for index, part in enumerate("KV"):
        xs, ys, fs = x[:, :, :, index], y[:, :, :, index], floor[:, :, :, index]
        rel = (ys - xs).abs() / xs.abs()
        out[f"{part}_max"] = rel[xs.abs() >= fs].max().item()
        out[f"{part}_mean"] = rel[xs != 0].mean().item()
        out[f"{part}_norm"] = ((ys - xs).norm() / xs.norm()).item()
    return out


def test_kv_like_round_trip_is_within_e4m3_error():
    codec = Fp8Codec(PAGE)
    values = kv_like(pages=8, heads=PAGE.heads, tokens=PAGE.tokens, head_dim=PAGE.head_dim).to(torch.bfloat16)
    payload = payload_of(values)
    stored = codec.encode(payload)
    assert len(stored) == codec.encoded_bound(len(payload)) == len(payload) // 2 + 8 * PAGE.heads * 8
    _, scales = quantize(values, PAGE)
    found = errors(values, decoded(codec, stored, len(payload)), scales)
    assert found["K_max"] <= NORMAL_BOUND and found["V_max"] <= NORMAL_BOUND, found
    assert found["K_mean"] < 0.03 and found["V_mean"] < 0.03, found
    assert found["K_norm"] < 0.04 and found["V_norm"] < 0.04, found


@pytest.mark.parametrize("order", ["HNKD", "KHND", "NHKD", "DKNH"])
def test_one_scale_per_page_head_and_kv_in_any_layout(order):
    page = PageShape(heads=3, tokens=5, head_dim=8, order=order)
    canonical = torch.randn(2, 3, 5, 2, 8)  # pages x H N K D
    canonical[1, 2, 4, 0, 7] = 1000.0  # one outlier: page 1, head 2, K
    memory = canonical.permute(0, *[1 + "HNKD".index(axis) for axis in order]).contiguous()
    codes, scales = quantize(memory.reshape(-1).to(torch.bfloat16), page)
    expected = canonical.to(torch.bfloat16).float().abs().amax(dim=(2, 4)) / E4M3_MAX
    assert torch.equal(scales, expected)
    assert scales[1, 2, 0] == 1000.0 / E4M3_MAX and scales[1, 2, 1] < 1 and scales[0, 2, 0] < 1
    restored = dequantize(codes, scales, page).float().reshape(memory.shape)
    back = restored.permute(0, *[1 + order.index(axis) for axis in "HNKD"])
    near = (back - canonical).abs() <= NORMAL_BOUND * canonical.abs() + scales[:, :, None, :, None] * 2 ** -9
    assert bool(near.all())


def test_fp16_round_trip_and_zero_pages():
    page = PageShape(heads=2, tokens=4, head_dim=16, dtype="float16")
    codec = Fp8Codec(page)
    values = torch.randn(3 * page.values) * 1000
    values[: page.values] = 0  # an all-zero page: scale 1, codes 0
    payload = payload_of(values, torch.float16)
    restored = decoded(codec, codec.encode(payload), len(payload), torch.float16)
    assert torch.equal(restored[: page.values], torch.zeros(page.values, dtype=torch.float16))
    rel = (restored.float() - values.to(torch.float16).float()).abs() / values.abs().clamp_min(1)
    assert rel.max() < 0.07


def test_non_finite_values_are_refused_at_encode():
    codec = Fp8Codec(PAGE)
    for bad in (float("nan"), float("inf"), -float("inf")):
        values = torch.randn(PAGE.values)
        values[17] = bad
        with pytest.raises(CodecError, match="NaN or infinite"):
            codec.encode(payload_of(values))


def test_lengths_that_are_not_whole_pages_or_the_exact_size_are_refused():
    codec = Fp8Codec(PAGE)
    payload = payload_of(torch.randn(2 * PAGE.values))
    stored = codec.encode(payload)
    with pytest.raises(CodecError, match="whole pages"):
        codec.encode(payload[:-2])
    with pytest.raises(CodecError, match="whole pages"):
        codec.decode(stored, bytearray(len(payload) - 2))
    for wrong in (stored[:-1], stored + b"\0", b""):
        with pytest.raises(CodecError, match="stored bytes"):
            codec.decode(wrong, bytearray(len(payload)))
    with pytest.raises(CodecError, match="smaller than"):
        codec.encode(payload, bytearray(10))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0, 200.0])
def test_hostile_scales_are_refused(scale):
    page = PageShape(heads=2, tokens=4, head_dim=16, dtype="float16")  # fp16: scales above 146 overflow
    codec = Fp8Codec(page)
    payload = payload_of(torch.randn(page.values), torch.float16)
    stored = bytearray(codec.encode(payload))
    stored[4:8] = torch.tensor([scale], dtype=torch.float32).numpy().tobytes()
    with pytest.raises(CodecError, match="scale"):
        codec.decode(bytes(stored), bytearray(len(payload)))


def test_nan_codes_are_refused():
    codec = Fp8Codec(PAGE)
    payload = payload_of(torch.randn(PAGE.values))
    stored = bytearray(codec.encode(payload))
    stored[-1] = 0xFF
    with pytest.raises(CodecError, match="NaN codes"):
        codec.decode(bytes(stored), bytearray(len(payload)))


def test_fuzz_random_stored_bytes_decode_to_finite_values_or_are_refused():
    codec = Fp8Codec(PAGE)
    payload_len = 2 * PAGE.page_bytes
    rng = random.Random(38)
    for _ in range(300):
        stored = rng.randbytes(codec.encoded_bound(payload_len))
        dst = bytearray(payload_len)
        try:
            codec.decode(stored, dst)
        except CodecError:
            continue
        assert bool(torch.isfinite(torch.frombuffer(dst, dtype=torch.bfloat16)).all())


def test_decode_tensor_writes_into_a_device_tensor():
    """The tensor path the GPU will use, here on the CPU (and on CUDA where there is one)."""
    codec = Fp8Codec(PAGE)
    payload = payload_of(torch.randn(2 * PAGE.values))
    stored = codec.encode(payload)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        out = torch.zeros(len(payload), dtype=torch.uint8, device=device)
        decode_tensor(torch.frombuffer(bytearray(stored), dtype=torch.uint8).to(device), out, PAGE)
        assert out.cpu().numpy().tobytes() == codec.decode_bytes(stored, len(payload))


def test_params_name_the_layout():
    assert Fp8Codec(PAGE).params == ("fp8:v1,e4m3,scale=block-layer-head-kv,dtype=bfloat16,heads=4,"
                                     "tokens=16,head_dim=64,order=HNKD")
    with pytest.raises(ValueError):
        PageShape(heads=1, tokens=1, head_dim=1, order="HNKK")
    with pytest.raises(ValueError):
        PageShape(heads=1, tokens=1, head_dim=1, dtype="float32")
