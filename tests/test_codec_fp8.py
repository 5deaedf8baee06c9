"""``pykv/codec/fp8.py``: e4m3 with one float32 scale per group of ``group`` consecutive values,
within e4m3's error, and stored bytes that do not fit refused with ``CodecError``."""

from __future__ import annotations

import random

import pytest
import torch

from pykv.codec import CodecError
from pykv.codec.fp8 import (
    DEFAULT_GROUP,
    E4M3_MAX,
    MAX_GROUP,
    Fp8Codec,
    decode_tensor,
    dequantize,
    kv_dtype_name,
    quantize,
)
from tests.test_codec_lossless import kv_like

HEADS, TOKENS, HEAD_DIM = 4, 16, 64  # one group of 64 = one head's K or V of one token
# e4m3 rounds to 3 mantissa bits (half an ulp: 2^-4 relative), the bf16 result to 8 (2^-9)
NORMAL_BOUND = 2 ** -4 + 2 ** -8


def payload_of(values: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bytes:
    return values.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()


def decoded(codec: Fp8Codec, stored: bytes, payload_len: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.frombuffer(bytearray(codec.decode_bytes(stored, payload_len)), dtype=dtype)


def scale_at(stored: bytes, index: int) -> float:
    return torch.frombuffer(bytearray(stored[4 * index: 4 * index + 4]), dtype=torch.float32).item()


def errors(original: torch.Tensor, restored: torch.Tensor, scales: torch.Tensor) -> dict[str, float]:
    """Relative errors of K and V of kv_like pages (one group per head, token and K/V): max over
    values in e4m3's normal range of their group's scale, mean over non-zero values, and the
    norm of the error over the norm of the values."""
    x = original.float().reshape(-1, HEADS, TOKENS, 2, HEAD_DIM)
    y = restored.float().reshape(x.shape)
    floor = scales.reshape(x.shape[:-1])[..., None] * 2 ** -6  # smallest normal e4m3 value, scaled
    out = {}
    for index, part in enumerate("KV"):
        xs, ys, fs = x[:, :, :, index], y[:, :, :, index], floor[:, :, :, index]
        rel = (ys - xs).abs() / xs.abs()
        normal = xs.abs() >= fs
        assert normal.float().mean() > 0.9  # the max below is over most values, not a few
        out[f"{part}_max"] = rel[normal].max().item()
        out[f"{part}_mean"] = rel[xs != 0].mean().item()
        out[f"{part}_norm"] = ((ys - xs).norm() / xs.norm()).item()
    return out


def test_kv_like_round_trip_is_within_e4m3_error():
    codec = Fp8Codec()
    assert (codec.dtype, codec.group) == ("bfloat16", DEFAULT_GROUP) == ("bfloat16", HEAD_DIM)
    values = kv_like(pages=8, heads=HEADS, tokens=TOKENS, head_dim=HEAD_DIM).to(torch.bfloat16)
    payload = payload_of(values)
    stored = codec.encode(payload)
    groups = values.numel() // 64
    assert len(stored) == codec.encoded_bound(len(payload)) == codec.stored_length(len(payload))
    assert len(stored) == values.numel() + 4 * groups == len(payload) // 2 + 4 * 8 * HEADS * TOKENS * 2
    codes, scales, bad = quantize(values, codec.group)
    assert not bool(bad) and scales.dtype == torch.float32 and scales.shape == (groups,)
    assert stored[: 4 * groups] == scales.numpy().tobytes() and stored[4 * groups:] == codes.numpy().tobytes()
    assert torch.equal(scales, values.float().reshape(-1, 64).abs().amax(dim=1) / E4M3_MAX)
    found = errors(values, decoded(codec, stored, len(payload)), scales)
    assert found["K_max"] <= NORMAL_BOUND and found["V_max"] <= NORMAL_BOUND, found
    assert found["K_mean"] < 0.03 and found["V_mean"] < 0.03, found
    assert found["K_norm"] < 0.04 and found["V_norm"] < 0.04, found
    assert found["K_mean"] > 0 and found["V_mean"] > 0, found  # lossy: it did quantize


@pytest.mark.parametrize("group", [1, 8, 64, 128])
def test_one_outlier_widens_its_own_groups_scale_only(group):
    values = torch.randn(40 * group, generator=torch.Generator().manual_seed(group)).to(torch.bfloat16)
    where = 17 * group + group // 2  # inside group 17
    spiked = values.clone()
    spiked[where] = 1000.0
    _, before, _ = quantize(values, group)
    codes, after, bad = quantize(spiked, group)
    assert not bool(bad)
    assert after[17] == 1000.0 / E4M3_MAX and before[17] < 5 / E4M3_MAX
    changed = (after != before).nonzero().reshape(-1).tolist()
    assert changed == [17]
    out = torch.empty(spiked.numel(), dtype=torch.bfloat16)
    assert not bool(dequantize(codes, after, out, group))
    assert out[where] == 1000.0
    others = torch.ones(spiked.numel(), dtype=torch.bool)
    others[17 * group: 18 * group] = False  # every other value keeps its own group's precision
    x, y = spiked.float()[others], out.float()[others]
    floor = after.repeat_interleave(group)[others] * 2 ** -9  # half the smallest subnormal step
    assert bool(((y - x).abs() <= NORMAL_BOUND * x.abs() + floor).all())


@pytest.mark.parametrize("group", [16, 64, 256])
def test_fp16_round_trip_and_all_zero_groups(group):
    codec = Fp8Codec("float16", group)
    assert codec.torch_dtype == torch.float16
    values = torch.randn(6 * group, generator=torch.Generator().manual_seed(3)) * 1000
    values[group: 3 * group] = 0  # two all-zero groups: scale 1, codes 0
    payload = payload_of(values, torch.float16)
    stored = codec.encode(payload)
    assert len(stored) == 6 * group + 4 * 6
    assert [scale_at(stored, i) for i in (1, 2)] == [1.0, 1.0]
    assert scale_at(stored, 0) == (values[:group].to(torch.float16).float().abs().max() / E4M3_MAX).item()
    assert not any(stored[24 + group: 24 + 3 * group])
    restored = decoded(codec, stored, len(payload), torch.float16)
    assert torch.equal(restored[group: 3 * group], torch.zeros(2 * group, dtype=torch.float16))
    rel = (restored.float() - values.to(torch.float16).float()).abs() / values.abs().clamp_min(1)
    assert rel.max() < 0.07 and rel.max() > 0


def test_an_empty_payload_stores_nothing():
    codec = Fp8Codec()
    assert codec.stored_length(0) == 0 and codec.encode(b"") == b""
    assert codec.decode_bytes(b"", 0) == b""


def test_non_finite_values_are_refused_at_encode():
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        codec = Fp8Codec(name)
        for bad in (float("nan"), float("inf"), -float("inf")):
            values = torch.randn(4 * 64)
            values[17 + 64 * 2] = bad
            with pytest.raises(CodecError, match="NaN or infinite"):
                codec.encode(payload_of(values, dtype))
            assert bool(quantize(values.to(dtype), 64)[2])


def test_lengths_that_are_not_whole_groups_or_the_exact_size_are_refused():
    codec = Fp8Codec(group=32)
    payload = payload_of(torch.randn(8 * 32))
    stored = codec.encode(payload)
    assert len(stored) == 8 * 32 + 4 * 8
    for length in (len(payload) - 2, 2 * 32 + 1, 1):
        with pytest.raises(CodecError, match="whole groups"):
            codec.encode(payload[:length])
        with pytest.raises(CodecError, match="whole groups"):
            codec.decode(stored, bytearray(length))
        with pytest.raises(CodecError, match="whole groups"):
            codec.stored_length(length)
    for wrong in (stored[:-1], stored + b"\0", b"", stored[4:], stored[:-32]):
        with pytest.raises(CodecError, match="stored bytes"):
            codec.decode(wrong, bytearray(len(payload)))
    with pytest.raises(CodecError, match="smaller than"):
        codec.encode(payload, bytearray(len(stored) - 1))
    out = bytearray(len(stored) + 5)
    assert codec.encode(payload, out) == len(stored) and bytes(out[: len(stored)]) == stored


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0, 200.0])
def test_hostile_scales_are_refused(scale):
    codec = Fp8Codec("float16", 16)  # fp16: scales above 65504 / 448 = 146.2 overflow
    payload = payload_of(torch.randn(3 * 16), torch.float16)
    stored = bytearray(codec.encode(payload))
    codec.decode(bytes(stored), bytearray(len(payload)))  # as encoded: accepted
    stored[4:8] = torch.tensor([scale], dtype=torch.float32).numpy().tobytes()  # group 1's scale
    with pytest.raises(CodecError, match="scale"):
        codec.decode(bytes(stored), bytearray(len(payload)))


def test_the_largest_scale_the_dtype_holds_is_accepted_and_stays_finite():
    codec = Fp8Codec("float16", 16)
    stored = bytearray(codec.encode(payload_of(torch.ones(16), torch.float16)))
    stored[0:4] = torch.tensor([146.0], dtype=torch.float32).numpy().tobytes()
    restored = decoded(codec, bytes(stored), 32, torch.float16)
    assert bool(torch.isfinite(restored).all()) and restored.max() == 448 * 146
    stored[0:4] = torch.tensor([147.0], dtype=torch.float32).numpy().tobytes()
    with pytest.raises(CodecError, match="scale"):
        codec.decode(bytes(stored), bytearray(32))


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_codes_are_refused(code):
    codec = Fp8Codec()
    payload = payload_of(torch.randn(2 * 64))
    stored = bytearray(codec.encode(payload))
    codec.decode(bytes(stored), bytearray(len(payload)))
    stored[-1] = code
    with pytest.raises(CodecError, match="code is NaN"):
        codec.decode(bytes(stored), bytearray(len(payload)))
    stored[-1] = code - 1  # e4m3's largest magnitude: a value, not NaN
    codec.decode(bytes(stored), bytearray(len(payload)))


def test_fuzz_random_stored_bytes_decode_to_finite_values_or_are_refused():
    rng = random.Random(38)
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        codec = Fp8Codec(name, 16)
        payload_len = 2 * 4 * 16
        accepted = refused = 0
        for _ in range(300):
            stored = bytearray(rng.randbytes(codec.stored_length(payload_len)))
            if rng.random() < 0.5:  # plausible scales, so that some inputs pass the scale check
                for index in range(4):
                    stored[4 * index: 4 * index + 4] = torch.tensor([rng.uniform(1e-6, 100.0)]).numpy().tobytes()
            dst = bytearray(payload_len)
            try:
                codec.decode(bytes(stored), dst)
            except CodecError:
                refused += 1
                continue
            accepted += 1
            assert bool(torch.isfinite(torch.frombuffer(dst, dtype=dtype)).all())
        assert accepted > 0 and refused > 0, (accepted, refused)


def test_decode_tensor_writes_into_a_device_tensor():
    """The tensor path the GPU uses, here on the CPU (and on CUDA where there is one)."""
    codec = Fp8Codec()
    payload = payload_of(torch.randn(8 * 64))
    stored = codec.encode(payload)
    expected = codec.decode_bytes(stored, len(payload))
    hostile = bytearray(stored)
    hostile[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        out = torch.zeros(len(payload), dtype=torch.uint8, device=device)
        bad = decode_tensor(torch.frombuffer(bytearray(stored), dtype=torch.uint8).to(device), out, codec)
        assert bad.device.type == device and not bool(bad)
        assert out.cpu().numpy().tobytes() == expected
        bad = decode_tensor(torch.frombuffer(hostile, dtype=torch.uint8).to(device), out, codec)
        assert bool(bad)
        values = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16)
        codes, scales, bad = quantize(values.to(device), 64)
        assert not bool(bad) and codes.device.type == scales.device.type == device
        # CUDA divides by 448 as a multiply by its reciprocal: a scale may be 1 ulp off the CPU's,
        # and a code then one step off, so the GPU's stored bytes are checked by what they decode to
        _, cpu_scales, _ = quantize(values, 64)
        assert torch.allclose(scales.cpu(), cpu_scales, rtol=2 ** -22, atol=0)
        restored = decoded(codec, scales.cpu().numpy().tobytes() + codes.cpu().numpy().tobytes(), len(payload))
        floor = cpu_scales.repeat_interleave(64) * 2 ** -9
        assert bool(((restored.float() - values.float()).abs() <= NORMAL_BOUND * values.float().abs() + floor).all())


def test_params_name_the_group_and_dtype():
    assert Fp8Codec().params == "fp8:v2,e4m3,group=64,scale=f32,dtype=bfloat16"
    assert Fp8Codec("float16", 128).params == "fp8:v2,e4m3,group=128,scale=f32,dtype=float16"
    assert Fp8Codec(group=1).stored_length(2) == 5 and Fp8Codec(group=MAX_GROUP).stored_length(2 * MAX_GROUP) == MAX_GROUP + 4


@pytest.mark.parametrize("dtype, group", [("float32", 64), ("bf16", 64), ("half", 64), ("", 64),
                                          ("bfloat16", 0), ("bfloat16", -64), ("float16", MAX_GROUP + 1)])
def test_invalid_dtype_or_group_is_a_value_error(dtype, group):
    with pytest.raises(ValueError, match="fp8"):
        Fp8Codec(dtype, group)


def test_kv_dtype_names():
    assert kv_dtype_name(torch.bfloat16) == "bfloat16" and kv_dtype_name("bf16") == "bfloat16"
    assert kv_dtype_name(torch.float16) == "float16" and kv_dtype_name("half") == "float16"
    assert kv_dtype_name("auto") is None and kv_dtype_name(torch.float32) is None
    assert kv_dtype_name(torch.float8_e4m3fn) is None
