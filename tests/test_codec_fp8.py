"""``pykv/codec/fp8.py``: e4m3 with one power-of-two scale (one E8M0 byte ``k + 127``) per group
of ``group`` consecutive values, within e4m3's error, and stored bytes that do not fit refused
with ``CodecError``."""

from __future__ import annotations

import random

import pytest
import torch

from pykv.codec import CodecError
from pykv.codec.fp8 import (
    DEFAULT_GROUP,
    E4M3_MAX,
    MAX_GROUP,
    SCALE_BIAS,
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


def scale_values(scale_bytes: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``2**(byte - 127)`` of E8M0 scale bytes, exactly."""
    return torch.ldexp(torch.ones(scale_bytes.shape), scale_bytes.to(torch.int32) - SCALE_BIAS)


def expected_scale_byte(amax: float) -> int:
    """127 + the smallest k with amax / 2**k <= 448, found by exact float (double) comparisons
    (an all-zero group: k = -9, as ``frexp(0)`` is ``0 * 2**0``; any scale decodes its zeros)."""
    if amax == 0:
        return 127 - 9
    k = 0
    while amax > E4M3_MAX * 2.0 ** k:
        k += 1
    while amax <= E4M3_MAX * 2.0 ** (k - 1):
        k -= 1
    return k + 127


def errors(original: torch.Tensor, restored: torch.Tensor, scales: torch.Tensor) -> dict[str, float]:
    """Relative errors of K and V of kv_like pages (one group per head, token and K/V): max over
    values in e4m3's normal range of their group's scale, mean over non-zero values, and the
    norm of the error over the norm of the values."""
    x = original.float().reshape(-1, HEADS, TOKENS, 2, HEAD_DIM)
    y = restored.float().reshape(x.shape)
    floor = scale_values(scales).reshape(x.shape[:-1])[..., None] * 2 ** -6  # smallest normal e4m3 value, scaled
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
    assert len(stored) == values.numel() + groups == len(payload) // 2 + 8 * HEADS * TOKENS * 2
    codes, scales, bad = quantize(values, codec.group)
    assert not bool(bad) and scales.dtype == torch.uint8 and scales.shape == (groups,)
    assert codes.dtype == torch.uint8 and codes.shape == (values.numel(),)
    # stored: every group's scale byte (in payload order), then one code per value
    assert stored[:groups] == scales.numpy().tobytes() and stored[groups:] == codes.numpy().tobytes()
    amax = values.double().reshape(-1, 64).abs().amax(dim=1).tolist()
    assert scales.tolist() == [expected_scale_byte(a) for a in amax]
    found = errors(values, decoded(codec, stored, len(payload)), scales)
    assert found["K_max"] <= NORMAL_BOUND and found["V_max"] <= NORMAL_BOUND, found
    # measured (kv_like, 8 pages): max 0.0588 (K and V), mean 0.0225 / 0.0226, norm 0.0265 / 0.0266
    assert found["K_mean"] < 0.027 and found["V_mean"] < 0.027, found
    assert found["K_norm"] < 0.032 and found["V_norm"] < 0.032, found
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
    # 1000 / 2**2 = 250 <= 448 < 1000 / 2**1: k = 2, byte 129; N(0, 1) values stay below 5,
    # and 5 / 2**-6 = 320 <= 448: their k is -6 or less
    assert after[17] == 127 + 2 and before[17] <= 127 - 6
    changed = (after != before).nonzero().reshape(-1).tolist()
    assert changed == [17]
    out = torch.empty(spiked.numel(), dtype=torch.bfloat16)
    assert not bool(dequantize(codes, after, out, group))
    assert out[where] == 1024.0  # 250 rounds to e4m3's 256 (steps of 16 in 128..256), times 2**2
    others = torch.ones(spiked.numel(), dtype=torch.bool)
    others[17 * group: 18 * group] = False  # every other value keeps its own group's precision
    x, y = spiked.float()[others], out.float()[others]
    floor = scale_values(after).repeat_interleave(group)[others] * 2 ** -9  # half the smallest subnormal step
    assert bool(((y - x).abs() <= NORMAL_BOUND * x.abs() + floor).all())


@pytest.mark.parametrize("group", [16, 64, 256])
def test_fp16_round_trip_and_all_zero_groups(group):
    codec = Fp8Codec("float16", group)
    assert codec.torch_dtype == torch.float16
    values = torch.randn(6 * group, generator=torch.Generator().manual_seed(3)) * 1000
    values[group: 3 * group] = 0  # two all-zero groups: codes 0, scale byte 118 (frexp(0) = 0 * 2**0: k = -9)
    payload = payload_of(values, torch.float16)
    stored = codec.encode(payload)
    assert len(stored) == 6 * group + 6
    assert list(stored[1:3]) == [118, 118]
    halves = values.to(torch.float16).double().reshape(6, group).abs().amax(dim=1).tolist()
    assert list(stored[:6]) == [expected_scale_byte(a) for a in halves]
    assert all(1 <= b <= 127 + 7 for b in stored[:6])  # fp16 holds 448 * 2**7 = 57344, not 448 * 2**8
    assert not any(stored[6 + group: 6 + 3 * group])
    restored = decoded(codec, stored, len(payload), torch.float16)
    assert torch.equal(restored[group: 3 * group], torch.zeros(2 * group, dtype=torch.float16))
    rel = (restored.float() - values.to(torch.float16).float()).abs() / values.abs().clamp_min(1)
    assert rel.max() < 0.07 and rel.max() > 0  # measured: 0.0479 (group 16), 0.0588 (64, 256)


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
    assert len(stored) == 8 * 32 + 8
    for length in (len(payload) - 2, 2 * 32 + 1, 1):
        with pytest.raises(CodecError, match="whole groups"):
            codec.encode(payload[:length])
        with pytest.raises(CodecError, match="whole groups"):
            codec.decode(stored, bytearray(length))
        with pytest.raises(CodecError, match="whole groups"):
            codec.stored_length(length)
    for wrong in (stored[:-1], stored + b"\0", b"", stored[1:], stored[8:], stored[:-32]):
        with pytest.raises(CodecError, match="stored bytes"):
            codec.decode(wrong, bytearray(len(payload)))
    with pytest.raises(CodecError, match="smaller than"):
        codec.encode(payload, bytearray(len(stored) - 1))
    out = bytearray(len(stored) + 5)
    assert codec.encode(payload, out) == len(stored) and bytes(out[: len(stored)]) == stored


@pytest.mark.parametrize("name, byte", [("bfloat16", 0), ("bfloat16", 255), ("bfloat16", 247),
                                        ("float16", 0), ("float16", 255), ("float16", 135)])
def test_hostile_scale_bytes_are_refused(name, byte):
    """Byte 0 (2**-127) and 255 (E8M0's NaN) are outside -126..126; 247 (2**120) overflows bf16
    (448 * 2**120 > 3.39e38), 135 (2**8) fp16 (448 * 2**8 > 65504)."""
    dtype = Fp8Codec(name).torch_dtype
    codec = Fp8Codec(name, 16)
    payload = payload_of(torch.randn(3 * 16), dtype)
    stored = bytearray(codec.encode(payload))
    codec.decode(bytes(stored), bytearray(len(payload)))  # as encoded: accepted
    stored[1] = byte  # group 1's scale
    with pytest.raises(CodecError, match="a scale the dtype cannot hold, or a NaN code"):
        codec.decode(bytes(stored), bytearray(len(payload)))


@pytest.mark.parametrize("name, largest", [("bfloat16", 127 + 119), ("float16", 127 + 7)])
def test_the_largest_scale_the_dtype_holds_is_accepted_and_stays_finite(name, largest):
    codec = Fp8Codec(name, 16)
    dtype = codec.torch_dtype
    stored = bytearray(codec.encode(payload_of(torch.ones(16), dtype)))
    stored[1:] = bytes([0x7E]) * 16  # e4m3's largest magnitude, 448, in every code
    for byte in (1, largest):  # the smallest scale, 2**-126, and the largest the dtype holds
        stored[0] = byte
        restored = decoded(codec, bytes(stored), 32, dtype)
        assert bool(torch.isfinite(restored).all())
        exact = torch.tensor(448 * 2.0 ** (byte - 127), dtype=torch.float64).to(dtype)  # fp16: 2**-119 is 0
        assert restored.tolist() == [exact.item()] * 16
    assert decoded(codec, bytes(stored), 32, dtype).max() == E4M3_MAX * 2 ** (largest - 127)
    stored[0] = largest + 1
    with pytest.raises(CodecError, match="scale"):
        codec.decode(bytes(stored), bytearray(32))


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_the_scale_is_the_smallest_power_of_two_bringing_the_groups_amax_to_448(name):
    codec = Fp8Codec(name, 4)
    dtype = codec.torch_dtype
    step = 2.0 ** (11 - (7 if dtype == torch.bfloat16 else 10))  # one ulp of dtype at 2048..4096
    cases = [  # (amax, byte): 127 + the smallest k with amax / 2**k <= 448
        (448 * 2 ** 3, 130), (448 * 2 ** 3 + step, 131), (-448 * 2 ** 3, 130),
        (448.0, 127), (448 + 2 * step / 16, 128),  # the next value after 448: 450 (bf16), 448.25 (fp16)
        (1.0, 127 - 8),  # 1 / 2**-8 = 256 <= 448 < 1 / 2**-9 = 512
        (224.0, 127 - 1), (224 + step / 16, 127),
        (448 * 2.0 ** -10, 117),
    ]
    for amax, byte in cases:
        values = torch.tensor([amax / 2, 0.0, amax, -amax / 8]).to(dtype)
        assert values[2].item() == amax  # the dtype holds amax exactly
        codes, scales, bad = quantize(values, 4)
        assert not bool(bad) and scales.tolist() == [byte] == [expected_scale_byte(abs(amax))], amax
        assert codec.encode(payload_of(values, dtype))[0] == byte
        # amax itself lands in 224..448 of e4m3 (its top binade), so the scale wastes no range
        assert 224 < abs(amax) / 2.0 ** (byte - 127) <= 448
        assert abs(codes.view(torch.float8_e4m3fn)[2].float().item()) > 224 - 16


@pytest.mark.parametrize("name, value, largest", [("float16", 60000.0, 57344.0), ("bfloat16", 3.0e38, 448 * 2.0 ** 119)])
def test_values_beyond_the_largest_scale_are_refused_at_encode_and_every_accepted_payload_decodes(name, value, largest):
    """A scale the decoder refuses is never written: such a block is not stored (recomputed)."""
    codec = Fp8Codec(name, 16)
    with pytest.raises(CodecError, match="beyond 448"):
        codec.encode(payload_of(torch.full((16,), value), codec.torch_dtype))
    _, _, bad = quantize(torch.full((16,), value).to(codec.torch_dtype), 16)
    assert bool(bad)
    at_the_limit = torch.full((16,), largest).to(codec.torch_dtype)
    restored = decoded(codec, codec.encode(payload_of(at_the_limit, codec.torch_dtype)), 32, codec.torch_dtype)
    assert torch.equal(restored, at_the_limit)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_codes_are_refused(code):
    codec = Fp8Codec()
    payload = payload_of(torch.randn(2 * 64))
    stored = bytearray(codec.encode(payload))
    codec.decode(bytes(stored), bytearray(len(payload)))
    stored[-1] = code
    with pytest.raises(CodecError, match="a NaN code"):
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
                stored[:4] = bytes(rng.randint(1, 127 + 7) for _ in range(4))
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
    hostile[0] = 255
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
        # power-of-two scales are exact: every device writes the CPU codec's bytes
        assert scales.cpu().numpy().tobytes() + codes.cpu().numpy().tobytes() == stored


def test_params_name_the_group_and_dtype():
    assert Fp8Codec().params == "fp8:v2,e4m3,group=64,scale=e8m0,dtype=bfloat16"
    assert Fp8Codec("float16", 128).params == "fp8:v2,e4m3,group=128,scale=e8m0,dtype=float16"
    assert Fp8Codec(group=1).stored_length(2) == 2 and Fp8Codec(group=MAX_GROUP).stored_length(2 * MAX_GROUP) == MAX_GROUP + 1


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
