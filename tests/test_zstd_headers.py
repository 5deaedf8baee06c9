"""``declared_sizes`` (pykv/codec/zstd_headers.py) reads what zstd reads or refuses, never more:
every size it reads equals ``zstandard.frame_content_size``'s for the same bytes, over pykv's own
frames, frames of other settings and thousands of mutated and truncated headers; and the
vectorized plane table and step layout give the per-frame walk's results and refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest
import zstandard

from pykv.codec.base import CodecError
from pykv.codec.lossless import PlanesZstdCodec
from pykv.codec.zstd_headers import declared_sizes


def _frames() -> list[bytes]:
    frames = []
    for size in (0, 1, 255, 256, 257, 65535, 65536, 65791, 65792, 300_000):
        data = bytes((np.arange(size) % 7).astype(np.uint8))
        for level in (1, 3, 19):
            frames.append(zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data))
        frames.append(zstandard.ZstdCompressor(level=1, write_checksum=True).compress(data))
        frames.append(zstandard.ZstdCompressor(level=1, write_content_size=False).compress(data))
    return frames


def _zstd_reads(frame: bytes) -> int:
    try:
        return zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        return -1


def test_every_size_read_is_zstds_over_good_mutated_and_truncated_headers():
    good = _frames()
    rng = random.Random(38)
    frames = list(good)
    for _ in range(30_000):
        frame = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 3)):
            frame[rng.randrange(min(len(frame), 18))] = rng.randrange(256)
        if rng.random() < 0.3:
            frame = frame[:rng.randrange(1, 19)]
        frames.append(bytes(frame))
    stored = np.frombuffer(b"".join(frames), dtype=np.uint8)
    lengths = np.array([len(f) for f in frames])
    read = declared_sizes(stored, np.cumsum(lengths) - lengths, lengths)
    for frame, size in zip(frames, read.tolist()):
        if size != -1:
            assert size == _zstd_reads(frame), frame[:18].hex()
    assert (read[:len(good)][::5] >= 0).all()  # level 1 with the content size: what pykv writes
    assert (read >= 0).sum() > len(good) // 2


def test_no_frames_and_an_empty_buffer():
    assert declared_sizes(np.empty(0, dtype=np.uint8), np.empty(0), np.empty(0)).size == 0
    assert declared_sizes(np.zeros(4, dtype=np.uint8), np.array([0]), np.array([4])).tolist() == [-1]


@pytest.mark.parametrize("chunk", [3000, 1 << 12, 1 << 20])
def test_the_plane_table_is_the_per_chunk_walks(chunk):
    codec = PlanesZstdCodec(chunk=chunk)
    payload = (np.random.default_rng(chunk).standard_normal(20_000) * 0.02).astype(np.float16).view(np.uint8)
    payload[:4000] = 0  # raw and coded planes both
    stored = np.frombuffer(codec.encode(payload), dtype=np.uint8)
    spans = codec.plane_spans(stored, payload.size)
    assert [start for start, _, _ in spans] == list(range(0, payload.size, chunk))
    position = codec._table_bytes(len(spans))
    for start, size, planes in spans:
        assert size == min(chunk, payload.size - start)
        for at, length in planes:
            assert at == position and 0 < length <= size // 2
            position += length
    assert position == stored.size
    assert codec.decode_bytes(stored.tobytes(), payload.size) == payload.tobytes()


@pytest.mark.parametrize("damage,match", [
    (lambda s: s + b"\0", "accounts for"), (lambda s: s[:-1], "accounts for"), (lambda s: s[:3], "cannot hold"),
    (lambda s: b"\0\0\0\0" + s[4:], "chunk 0 plane 0: 0 stored bytes"),
    (lambda s: b"\xff\xff\x00\x00" + s[4:], "chunk 0 plane 0: 65535 stored bytes for a 1500-byte plane")])
def test_a_damaged_table_is_refused_with_the_walks_messages(damage, match):
    codec = PlanesZstdCodec(chunk=3000)
    stored = codec.encode(np.zeros(9000, dtype=np.uint8))
    with pytest.raises(CodecError, match=match):
        codec.plane_table(damage(stored), 9000)


def test_check_frames_names_the_first_bad_frame_as_check_frame_does():
    codec = PlanesZstdCodec()
    good = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(1000))
    other = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(999))
    stored = np.frombuffer(good + other + good, dtype=np.uint8)
    positions = np.array([0, len(good), len(good) + len(other)])
    lengths = np.array([len(good), len(other), len(good)])
    codec.check_frames(stored, positions[[0, 2]], lengths[[0, 2]], np.array([1000, 1000]))
    with pytest.raises(CodecError, match="declares 999 bytes, the plane has 1000"):
        codec.check_frames(stored, positions, lengths, np.array([1000, 1000, 1000]))
    with_dictionary = bytearray(good)
    with_dictionary[4] |= 1  # a dictionary id flag: zstd reads a size (shifted), pykv never writes one
    with pytest.raises(CodecError):
        codec.check_frames(np.frombuffer(bytes(with_dictionary), dtype=np.uint8), np.array([0]),
                           np.array([len(good)]), np.array([1000]))
