"""``pykv/codec/lossless.py``: ``planes-zstd`` restores every bit, and refuses hostile stored
bytes with ``CodecError`` only (no other exception, no hang, no allocation past the payload)."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch
import zstandard

from pykv.codec import CodecError
from pykv import bench_codecs
from pykv.codec.lossless import PlanesZstdCodec

CHUNK = 1 << 14  # small chunks: many table entries and frames in a small payload


def bf16_bytes(values: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bytes:
    return values.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()


def kv_like(pages: int = 8, heads: int = 4, tokens: int = 16, head_dim: int = 64, seed: int = 0) -> torch.Tensor:
    """``pykv.bench_codecs.kv_like`` with these tests' small default shape."""
    return bench_codecs.kv_like(pages, heads, tokens, head_dim, seed)


SAMPLES = {
    "random-bf16-bits": lambda: np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes(),
    "gaussian-bf16": lambda: bf16_bytes(torch.randn(50_000, generator=torch.Generator().manual_seed(2))),
    "kv-like-bf16": lambda: bf16_bytes(kv_like()),
    "kv-like-fp16": lambda: bf16_bytes(kv_like(), torch.float16),
    "all-zero": lambda: bytes(1 << 16),
    "nan-inf": lambda: bf16_bytes(torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40] * 3000)),
    "odd-chunk-tail": lambda: bf16_bytes(torch.randn(CHUNK // 2 * 3 + 7)),
    "one-value": lambda: b"\x80\x3f",
    "empty": lambda: b"",
}


@pytest.fixture(scope="module")
def codec():
    c = PlanesZstdCodec(chunk=CHUNK)
    yield c
    c.close()


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_round_trip_is_exact(codec, sample):
    payload = SAMPLES[sample]()
    stored = codec.encode(payload)
    assert len(stored) <= codec.encoded_bound(len(payload))
    assert codec.decode_bytes(stored, len(payload)) == payload


def test_nan_payloads_keep_their_bits(codec):
    bits = np.array([0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x7F80, 0xFF80], dtype=np.uint16)  # quiet, payload, signalling NaNs, infs
    payload = np.tile(bits, 1000).tobytes()
    assert codec.decode_bytes(codec.encode(payload), len(payload)) == payload


def test_kv_like_data_shrinks_and_zero_data_nearly_vanishes(codec):
    payload = SAMPLES["kv-like-bf16"]()
    assert len(codec.encode(payload)) < 0.8 * len(payload)
    zero = SAMPLES["all-zero"]()
    assert len(codec.encode(zero)) < 0.02 * len(zero)


def test_incompressible_planes_are_stored_raw_within_the_bound(codec):
    payload = SAMPLES["random-bf16-bits"]()
    stored = codec.encode(payload)
    assert len(stored) == codec.encoded_bound(len(payload))  # every plane raw: table + payload


def test_encode_into_a_buffer_and_threads_give_the_same_bytes():
    payload = SAMPLES["kv-like-bf16"]()
    one, four = PlanesZstdCodec(chunk=CHUNK), PlanesZstdCodec(chunk=CHUNK, threads=4)
    try:
        out = bytearray(one.encoded_bound(len(payload)))
        written = four.encode(payload, out)
        assert bytes(out[:written]) == one.encode(payload)
        dst = np.zeros(len(payload), dtype=np.uint8)
        four.decode(memoryview(out)[:written], dst)
        assert dst.tobytes() == payload
        with pytest.raises(CodecError, match="smaller than"):
            one.encode(payload, bytearray(10))
    finally:
        four.close()


def test_params_name_everything_the_bytes_depend_on(codec):
    assert codec.params == f"planes-zstd:v1,elem=2,level=1,chunk={CHUNK}"
    assert PlanesZstdCodec(level=3).params != PlanesZstdCodec().params


def test_odd_payload_length_is_refused(codec):
    with pytest.raises(CodecError, match="whole number"):
        codec.encode(b"\x00\x01\x02")
    with pytest.raises(CodecError, match="whole number"):
        codec.encoded_bound(3)


# -- hostile stored bytes --------------------------------------------------------------------

def refused_or_exact(codec: PlanesZstdCodec, stored: bytes, payload_len: int) -> None:
    """Decoding hostile bytes either raises ``CodecError`` or fills exactly the payload."""
    dst = bytearray(payload_len)
    try:
        codec.decode(stored, dst)
    except CodecError:
        return
    assert len(dst) == payload_len


def first_high_plane(codec: PlanesZstdCodec, stored: bytes, payload_len: int) -> tuple[int, int]:
    """(offset, length) of the first chunk's high-byte plane: a zstd frame for KV-like data."""
    table = 4 * codec.elem * len(codec._chunks(payload_len))
    low, high = struct.unpack_from("<2I", stored, 0)
    assert high < CHUNK // 2
    return table + low, high


def replace_high_plane(stored: bytes, at: int, length: int, frame: bytes) -> bytes:
    out = bytearray(stored[:at] + frame + stored[at + length:])
    struct.pack_into("<I", out, 4, len(frame))
    return bytes(out)


def test_a_frame_declaring_another_size_is_refused(codec):
    payload = SAMPLES["kv-like-bf16"]()
    stored = codec.encode(payload)
    at, length = first_high_plane(codec, stored, len(payload))
    frame = stored[at:at + length]
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))  # 64 MiB of zeros in ~2 KiB
    assert zstandard.frame_content_size(bomb) == 64 << 20 and len(bomb) < CHUNK // 2
    with pytest.raises(CodecError, match="declares"):
        codec.decode(replace_high_plane(stored, at, length, bomb), bytearray(len(payload)))
    # the right declared size, but a second frame or trailing bytes behind it
    skippable = struct.pack("<II", 0x184D2A50, 4) + b"junk"
    empty = zstandard.ZstdCompressor(level=1).compress(b"")
    for tail in (frame, b"\0\0\0", b"\x28\xb5\x2f", skippable, empty, b"\x28\xb5\x2f\xfd"):
        with pytest.raises(CodecError):
            codec.decode(replace_high_plane(stored, at, length, frame + tail), bytearray(len(payload)))
    assert codec.decode_bytes(replace_high_plane(stored, at, length, frame), len(payload)) == payload


def test_a_frame_without_a_declared_size_is_refused(codec):
    payload = bf16_bytes(torch.zeros(CHUNK // 2))
    plane = bytes(CHUNK // 2)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(plane)
    stored = struct.pack("<2I", len(unsized), len(unsized)) + unsized + unsized
    with pytest.raises(CodecError, match="declares"):
        codec.decode(stored, bytearray(len(payload)))


def test_wrong_sizes_are_refused(codec):
    payload = SAMPLES["kv-like-bf16"]()
    stored = codec.encode(payload)
    for length in (len(payload) - 2, len(payload) + 2, len(payload) * 2, 0):
        with pytest.raises(CodecError):
            codec.decode(stored, bytearray(length))
    with pytest.raises(CodecError):
        codec.decode(stored + b"\0", bytearray(len(payload)))
    with pytest.raises(CodecError, match="table"):
        codec.decode(b"\0" * 4, bytearray(len(payload)))


def test_a_plane_longer_than_raw_or_empty_is_refused(codec):
    plane = CHUNK // 2
    with pytest.raises(CodecError, match="stored bytes for"):
        codec.decode(struct.pack("<2I", plane + 1, plane - 1) + bytes(2 * plane), bytearray(CHUNK))
    with pytest.raises(CodecError, match="stored bytes for"):
        codec.decode(struct.pack("<2I", 0, plane) + bytes(plane), bytearray(CHUNK))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sample", ["kv-like-bf16", "all-zero", "gaussian-bf16"])
def test_fuzz_truncation_flips_and_garbage(codec, sample):
    payload = SAMPLES[sample]()
    stored = codec.encode(payload)
    rng = random.Random(sample)
    cuts = sorted({rng.randrange(len(stored)) for _ in range(200)} | {0, 1, 7, 8, len(stored) - 1})
    for cut in cuts:
        with pytest.raises(CodecError):
            codec.decode(stored[:cut], bytearray(len(payload)))
    at, length = first_high_plane(codec, stored, len(payload))
    for _ in range(1500):
        damaged = bytearray(stored)
        for _ in range(rng.choice((1, 1, 2, 8))):  # half the flips inside a zstd frame
            position = rng.randrange(at, at + length) if rng.random() < 0.5 else rng.randrange(len(damaged))
            damaged[position] ^= 1 << rng.randrange(8)
        refused_or_exact(codec, bytes(damaged), len(payload))
    for _ in range(300):
        garbage = bytearray(rng.randbytes(rng.randrange(1, len(stored) + 64)))
        if rng.random() < 0.5 and len(garbage) >= 12:  # a plausible table and a zstd magic
            struct.pack_into("<2I", garbage, 0, rng.randrange(CHUNK), rng.randrange(CHUNK))
            garbage[8:12] = b"\x28\xb5\x2f\xfd"
        refused_or_exact(codec, bytes(garbage), len(payload))


def test_fuzz_frames_with_damaged_headers(codec):
    """Each byte of a frame's header set to every interesting value: refused or exact."""
    payload = SAMPLES["kv-like-bf16"]()
    stored = codec.encode(payload)
    at, _ = first_high_plane(codec, stored, len(payload))
    for offset in range(at, at + 16):
        for value in (0x00, 0x01, 0x7F, 0x80, 0xFF):
            damaged = bytearray(stored)
            damaged[offset] = value
            refused_or_exact(codec, bytes(damaged), len(payload))


@pytest.mark.parametrize("elem", [1, 4])
def test_other_value_sizes_round_trip(elem):
    codec = PlanesZstdCodec(elem=elem, chunk=CHUNK)
    payload = torch.randn(10_000).numpy().tobytes()  # float32: four planes, or one
    stored = codec.encode(payload)
    assert len(stored) < len(payload) and codec.decode_bytes(stored, len(payload)) == payload


@pytest.mark.parametrize("elem", [1, 2, 4])
def test_planes_merge_writes_every_byte_of_what_split_took_apart(elem):
    from pykv.codec import planes
    rng = np.random.default_rng(elem)
    for values in (0, 1, 7, 4099):
        data = rng.integers(0, 256, values * elem, dtype=np.uint8)
        parts = planes.split(memoryview(data), elem)
        assert [len(p) for p in parts] == [values] * elem
        assert all(np.array_equal(p, data[i::elem]) for i, p in enumerate(parts))
        out = np.full(values * elem, 0xA5, dtype=np.uint8)
        planes.merge(out, parts, elem)
        assert np.array_equal(out, data)


def test_a_frame_with_a_huge_window_behind_the_plane_is_refused_before_it_is_decoded(codec):
    """The bytes behind a plane's frame are never decoded: a second frame asking for a 128 MiB
    window (no content size) is refused without zstd sizing a buffer by it."""
    import resource
    payload = SAMPLES["kv-like-bf16"]()
    stored = codec.encode(payload)
    at, length = first_high_plane(codec, stored, len(payload))
    frame = stored[at:at + length]
    tail = bytes([0x28, 0xB5, 0x2F, 0xFD, 0x00, (27 - 10) << 3]) + bytes([0x01, 0x00, 0x00])  # window 2^27, a raw empty last block
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CodecError, match="unused data"):
        codec.decode(replace_high_plane(stored, at, length, frame + tail), bytearray(len(payload)))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: far below 128 MiB


def test_the_bound_of_a_huge_payload_is_arithmetic():
    """A header may claim any raw length up to the format's limit; the stored bound for it takes
    no memory or time that grows with the chunk count (a planted header costs the reader nothing)."""
    import time
    import tracemalloc
    codec = PlanesZstdCodec(chunk=16 << 10)
    tracemalloc.start()
    started = time.perf_counter()
    bound = codec.encoded_bound(1 << 36)
    elapsed = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert bound == (1 << 36) + (1 << 36) // (16 << 10) * 2 * 4
    assert peak < 64 << 10 and elapsed < 0.05


def test_threads_leave_the_output_alone_once_a_chunk_is_refused():
    """With a thread pool, a refused chunk raises only after every chunk's job ended: no job
    writes into the caller's buffer after ``decode`` returned."""
    import time
    codec = PlanesZstdCodec(chunk=1 << 20, threads=2)
    try:
        payload = bf16_bytes(torch.randn(8 << 20, generator=torch.Generator().manual_seed(5)))
        stored = bytearray(codec.encode(payload))
        position, length = codec.plane_spans(stored, len(payload))[0][2][1]
        stored[position + length - 3] ^= 0xFF  # chunk 0 fails late in its frame
        for _ in range(5):
            dst = np.zeros(len(payload), dtype=np.uint8)
            with pytest.raises(CodecError):
                codec.decode(stored, dst)
            after = dst.copy()
            time.sleep(0.05)
            assert np.array_equal(dst, after)
    finally:
        codec.close()
