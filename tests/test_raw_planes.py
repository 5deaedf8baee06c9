"""``device_zstd.step_layout`` and ``RawPlanes`` (the lossless device step's host layout and its
raw planes' gather), on CPU tensors with zstandard standing in for nvCOMP: every block's stored
bytes go to the stored scratch whole, one range each; frames and raw planes are found there; the
rows they rebuild equal the CPU decoder's payload byte for byte, whatever mix of raw and coded
planes, short last chunks and gather batches; a stored block longer than its row is refused."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pykv.codec.base import CodecError  # noqa: E402
from pykv.codec.lossless import PlanesZstdCodec  # noqa: E402
from pykv.connector.device_zstd import RawPlanes, step_layout  # noqa: E402
from pykv.connector.zstd_frames import HostFrames  # noqa: E402


def payloads(kind: str, count: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` payloads of ``length`` bytes of 2-byte values: ``random`` (every plane raw),
    ``kv`` (bf16-like: a coded exponent plane, a raw mantissa plane), ``zeros`` (all coded) or
    ``mixed`` (one of each per block)."""
    rng = np.random.default_rng(seed)
    made = []
    for index in range(count):
        which = kind if kind != "mixed" else ("random", "kv", "zeros")[index % 3]
        if which == "random":
            made.append(rng.integers(0, 256, length, dtype=np.uint8))
        elif which == "zeros":
            made.append(np.zeros(length, dtype=np.uint8))
        else:
            values = (torch.randn(length // 2, generator=torch.Generator().manual_seed(seed + index)) * 0.02)
            made.append(values.to(torch.bfloat16).view(torch.uint8).numpy().copy())
    return made


def decode_step(codec: PlanesZstdCodec, blocks: list[np.ndarray], length: int, raw_planes: RawPlanes | None = None):
    """Rows as the device step builds them (whole stored bytes, frames, raw planes)."""
    stored = []
    for block in blocks:
        buffer = np.empty(codec.encoded_bound(length), dtype=np.uint8)
        stored.append(buffer[:codec.encode(block, buffer)])
    stored_row = codec.encoded_bound(length)
    layout = step_layout(codec, stored, length, stored_row)
    scratch = torch.full((len(blocks) * stored_row,), 0xEE, dtype=torch.uint8)
    for row, at, into, to, size in layout.moves.tolist():
        assert (at, into) == (0, 0)
        scratch[to:to + size] = torch.from_numpy(stored[row])
    rows = torch.full((len(blocks), length), 0x55, dtype=torch.uint8)
    HostFrames(codec).decode(scratch, layout.frames, rows.view(-1), layout.outputs)
    (raw_planes or RawPlanes(codec, rows.numel(), torch.device("cpu"))).place(scratch, rows, layout.raw)
    return layout, stored, rows


def planes_of(block: np.ndarray, codec: PlanesZstdCodec) -> np.ndarray:
    """A payload as its row: each chunk's byte planes at ``p`` planes + chunk start / elem."""
    row = np.empty_like(block)
    plane_length = len(block) // codec.elem
    for start in range(0, len(block), codec.chunk):
        values = block[start:start + codec.chunk].reshape(-1, codec.elem)
        for plane in range(codec.elem):
            at = plane * plane_length + start // codec.elem
            row[at:at + len(values)] = values[:, plane]
    return row


@pytest.mark.parametrize("kind", ["random", "kv", "zeros", "mixed"])
@pytest.mark.parametrize("chunk,length", [(3000, 16384), (4096, 16384), (1 << 16, 1 << 16), (8192, 3 * 8192 + 1000)])
def test_rows_equal_the_payloads_planes_byte_for_byte(kind, chunk, length):
    codec = PlanesZstdCodec(chunk=chunk)
    blocks = payloads(kind, 4, length, seed=chunk)
    layout, stored, rows = decode_step(codec, blocks, length)
    for index, block in enumerate(blocks):
        assert np.array_equal(rows[index].numpy(), planes_of(block, codec)), index
        decoded = np.empty(length, dtype=np.uint8)
        codec.decode(stored[index], decoded)
        assert np.array_equal(decoded, block)  # the CPU decoder agrees
    assert len(layout.moves) == len(blocks)  # one range per block, whatever its planes
    assert len(layout.frames) + len(layout.raw) == len(blocks) * codec.elem * codec.chunk_count(length)


def test_every_kind_of_plane_is_met():
    codec = PlanesZstdCodec(chunk=3000)
    layout, _, _ = decode_step(codec, payloads("mixed", 3, 16384), 16384)
    lengths = layout.raw[:, 4]
    assert (lengths == 1500).any() and (lengths < 1500).any() and len(layout.frames)  # whole, short, coded


def test_gather_batches_smaller_than_the_step_give_the_same_rows(monkeypatch):
    codec = PlanesZstdCodec(chunk=4096)
    blocks = payloads("random", 3, 16384, seed=5)
    monkeypatch.setattr(RawPlanes, "BATCH_BYTES", 3 * 2048)  # three planes a batch: many batches
    small = RawPlanes(codec, 3 * 16384, torch.device("cpu"))
    assert small._scratch.numel() == 3 * 2048
    _, _, rows = decode_step(codec, blocks, 16384, small)
    for index, block in enumerate(blocks):
        assert np.array_equal(rows[index].numpy(), planes_of(block, codec))


def test_raw_planes_write_only_their_places():
    """Where the layout has no plane (here: none coded, rows left as they were), nothing is written."""
    codec = PlanesZstdCodec(chunk=4096)
    blocks = payloads("zeros", 2, 16384)
    layout, _, rows = decode_step(codec, blocks, 16384)
    assert len(layout.raw) == 0 and not rows.any()


def test_a_stored_block_longer_than_its_row_is_refused():
    codec = PlanesZstdCodec(chunk=4096)
    block = payloads("random", 1, 16384)[0]
    buffer = np.empty(codec.encoded_bound(16384), dtype=np.uint8)
    stored = buffer[:codec.encode(block, buffer)]
    with pytest.raises(CodecError, match="stored bytes"):
        step_layout(codec, [stored], 16384, len(stored) - 1)


def test_a_table_claiming_a_plane_past_its_stored_bytes_is_refused():
    codec = PlanesZstdCodec(chunk=4096)
    block = payloads("random", 1, 16384)[0]
    buffer = np.empty(codec.encoded_bound(16384), dtype=np.uint8)
    stored = buffer[:codec.encode(block, buffer)].copy()
    stored[:4] = np.frombuffer(np.uint32(1000).tobytes(), dtype=np.uint8)  # chunk 0 plane 0 shorter: not accounted
    with pytest.raises(CodecError):
        step_layout(codec, [stored], 16384, codec.encoded_bound(16384))
