"""``planes-zstd``: lossless; byte planes of 16-bit KV values, each entropy-coded by zstd.

Stored bytes (little endian)::

    table   chunks x planes  u32   stored length of each plane of each chunk
    data                           the planes, in table order

The payload is cut into chunks of ``chunk`` bytes (the last may be shorter); each chunk's
``elem`` planes are coded apart. A plane whose zstd frame would not be smaller than the plane
is stored raw: a stored length equal to the plane's length means raw, a smaller one a zstd
frame, a larger one is refused. The chunk count comes from the trusted payload length, so the
table's size is known before a stored byte is read; every frame must declare exactly its
plane's length and decode to exactly that into a bounded buffer, trailing bytes are refused.
Chunks are independent: with ``threads`` > 1 they are coded on a thread pool (zstd and numpy
release the GIL).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import zstandard

from pykv.codec import planes
from pykv.codec.base import Buffer, Codec, CodecError, byte_view
from pykv.codec.zstd_headers import declared_sizes

_LENGTH = struct.Struct("<I")
FORMAT_REVISION = 1
MAX_CHUNK = 1 << 30
_T = TypeVar("_T")


@dataclass(frozen=True)
class PlaneTable:
    """A stored payload's table: per chunk its start and plane length (raw bytes / ``elem``),
    per chunk and plane the stored bytes' position and length (int64 arrays)."""

    starts: np.ndarray
    plane_lengths: np.ndarray
    positions: np.ndarray
    lengths: np.ndarray


class PlanesZstdCodec(Codec):
    """Lossless codec for payloads of ``elem``-byte values (2 for bf16/fp16 KV)."""

    name = "planes-zstd"

    def __init__(self, *, elem: int = 2, level: int = 1, chunk: int = 1 << 20, threads: int = 1) -> None:
        if elem not in (1, 2, 4):
            raise ValueError(f"elem must be 1, 2 or 4 bytes, not {elem}")
        if not 0 < chunk <= MAX_CHUNK or chunk % elem:
            raise ValueError(f"chunk must be a multiple of {elem} in 1..{MAX_CHUNK} bytes, not {chunk}")
        if not -7 <= level <= 19:
            raise ValueError(f"zstd level must be in -7..19, not {level}")
        self.elem, self.level, self.chunk, self.threads = elem, level, chunk, max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, "pykv-codec") if self.threads > 1 else None
        self._contexts = threading.local()  # zstd contexts are not thread-safe: one per thread

    @property
    def params(self) -> str:
        return f"{self.name}:v{FORMAT_REVISION},elem={self.elem},level={self.level},chunk={self.chunk}"

    def chunk_count(self, payload_len: int) -> int:
        """The chunks of a payload of ``payload_len`` bytes (the last may be shorter);
        ``CodecError`` unless it is a whole number of values."""
        if payload_len % self.elem:
            raise CodecError(self.name, f"a payload of {payload_len} bytes is not a whole number of "
                                        f"{self.elem}-byte values")
        return -(-payload_len // self.chunk)

    def _chunks(self, payload_len: int) -> list[tuple[int, int]]:
        return [(index * self.chunk, min(self.chunk, payload_len - index * self.chunk))
                for index in range(self.chunk_count(payload_len))]

    def _table_bytes(self, chunks: int) -> int:
        return chunks * self.elem * _LENGTH.size

    def encoded_bound(self, payload_len: int) -> int:
        return self._table_bytes(self.chunk_count(payload_len)) + payload_len  # no list: a header's length

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, src: Buffer, out: Buffer | None = None) -> bytes | int:
        payload = byte_view(src)
        chunks = self._chunks(len(payload))
        pieces = self._map(lambda c: self._encode_chunk(payload[c[0]:c[0] + c[1]]), chunks)
        table = self._table_bytes(len(chunks))
        lengths = [len(piece) for chunk in pieces for piece in chunk]
        if out is None:
            return b"".join([struct.pack(f"<{len(lengths)}I", *lengths), *(p for c in pieces for p in c)])
        total = table + sum(lengths)
        target = byte_view(out, writable=True)
        if len(target) < total:
            raise CodecError(self.name, f"output buffer of {len(target)} bytes is smaller than the "
                                        f"{total} encoded bytes")
        struct.pack_into(f"<{len(lengths)}I", target, 0, *lengths)
        position = table
        for piece in (p for c in pieces for p in c):
            target[position:position + len(piece)] = piece
            position += len(piece)
        return total

    def _encode_chunk(self, values: memoryview) -> list[memoryview]:
        compressor = getattr(self._contexts, "compressor", None)
        if compressor is None:
            compressor = self._contexts.compressor = zstandard.ZstdCompressor(
                level=self.level, write_content_size=True, write_checksum=False)
        out = []
        for plane in planes.split(values, self.elem):
            frame = compressor.compress(plane)
            out.append(memoryview(frame) if len(frame) < len(plane) else memoryview(plane).cast("B"))
        return out

    # -- decoding ---------------------------------------------------------------------------

    def decode(self, src: Buffer, dst: Buffer) -> None:
        stored, target = byte_view(src), byte_view(dst, writable=True)
        jobs = self.plane_spans(stored, len(target))
        out = np.frombuffer(target, dtype=np.uint8)
        self._map(lambda job: self._decode_chunk(stored, out, *job), jobs)

    def plane_table(self, stored: Buffer, payload_len: int) -> PlaneTable:
        """The table of a payload of ``payload_len`` bytes stored as ``stored``, read and checked
        at once (numpy): a plane's stored length equal to the plane's is raw, a smaller one a zstd
        frame; ``CodecError`` for a longer or empty one, or a table that does not account for
        exactly the stored bytes. The chunk count comes from ``payload_len`` (trusted)."""
        stored = byte_view(stored)
        count = self.chunk_count(payload_len)
        table = self._table_bytes(count)
        if len(stored) < table:
            raise CodecError(self.name, f"{len(stored)} stored bytes cannot hold the {table}-byte table")
        starts = np.arange(count, dtype=np.int64) * self.chunk
        plane_lengths = (np.minimum(self.chunk, payload_len - starts) // self.elem)[:, None]
        lengths = np.frombuffer(stored, dtype="<u4", count=count * self.elem).astype(np.int64).reshape(count, self.elem)
        wrong = (lengths > plane_lengths) | ((lengths == 0) & (plane_lengths > 0))
        if wrong.any():
            index, plane = (int(i) for i in np.argwhere(wrong)[0])
            raise CodecError(self.name, f"chunk {index} plane {plane}: {lengths[index, plane]} stored bytes "
                                        f"for a {plane_lengths[index, 0]}-byte plane")
        ends = table + np.cumsum(lengths.ravel())
        if (ends[-1] if ends.size else table) != len(stored):
            raise CodecError(self.name, f"table accounts for {ends[-1] if ends.size else table} bytes, "
                                        f"{len(stored)} stored")
        return PlaneTable(starts, plane_lengths[:, 0], (ends - lengths.ravel()).reshape(lengths.shape), lengths)

    def plane_spans(self, stored: Buffer, payload_len: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """``(start, size, [(position, length) of each plane])`` of every chunk: ``plane_table``'s
        rows (the CPU decoder's jobs)."""
        table = self.plane_table(stored, payload_len)
        return [(start, plane * self.elem, list(zip(positions, lengths)))
                for start, plane, positions, lengths in zip(table.starts.tolist(), table.plane_lengths.tolist(),
                                                             table.positions.tolist(), table.lengths.tolist())]

    def check_frame(self, frame: Buffer, plane_len: int) -> None:
        """``CodecError`` unless ``frame`` is a zstd frame header declaring exactly ``plane_len``
        bytes (read before any byte of it is decoded, here or on the GPU)."""
        try:
            declared = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as error:
            raise CodecError(self.name, f"bad zstd frame header: {error}") from None
        if declared != plane_len:
            raise CodecError(self.name, f"zstd frame declares {declared} bytes, the plane has {plane_len}")

    def check_frames(self, stored: np.ndarray, positions: np.ndarray, lengths: np.ndarray,
                     plane_lengths: np.ndarray) -> None:
        """``check_frame`` for many frames of ``stored`` at once (``zstd_headers``: stricter than
        zstd where a header has a dictionary id or a window pykv never writes): ``CodecError``
        naming the first that fails."""
        wrong = np.flatnonzero(declared_sizes(stored, positions, lengths) != plane_lengths)
        if wrong.size:
            first = int(wrong[0])
            position, length = int(positions[first]), int(lengths[first])
            self.check_frame(stored[position:position + length], int(plane_lengths[first]))
            raise CodecError(self.name, "zstd frame header with a dictionary, a reserved bit or a window pykv "
                                        "never writes")

    def _decode_chunk(self, stored: memoryview, out: np.ndarray, start: int, size: int,
                      spans: list[tuple[int, int]]) -> None:
        plane_len = size // self.elem
        restored = []
        for position, length in spans:
            data = stored[position:position + length]
            if length == plane_len:
                restored.append(np.frombuffer(data, dtype=np.uint8))
            else:
                plane = np.empty(plane_len, dtype=np.uint8)
                self.inflate(data, plane)
                restored.append(plane)
        planes.merge(out[start:start + size], restored, self.elem)

    def inflate(self, frame: memoryview, into: np.ndarray) -> None:
        """Decode one zstd frame declaring exactly ``len(into)`` bytes into ``into``."""
        self.check_frame(frame, len(into))
        decompressor = getattr(self._contexts, "decompressor", None)
        if decompressor is None:
            decompressor = self._contexts.decompressor = zstandard.ZstdDecompressor()
        try:
            # one frame, every byte of it: trailing bytes or a second frame behind it are refused
            data = decompressor.decompress(frame, max_output_size=len(into), allow_extra_data=False)
        except zstandard.ZstdError as error:
            raise CodecError(self.name, f"corrupt zstd frame: {error}") from None
        if len(data) != len(into):
            raise CodecError(self.name, f"zstd frame decodes to {len(data)} bytes, not {len(into)}")
        into[:] = np.frombuffer(data, dtype=np.uint8)

    def _map(self, fn: Callable[[_T], object], items: Iterable[_T]) -> list:
        items = list(items)
        if self._pool is None or len(items) < 2:
            return [fn(item) for item in items]
        futures = [self._pool.submit(fn, item) for item in items]
        wait(futures)  # every job ended before any error is raised: none writes after the caller is told
        return [future.result() for future in futures]

    def close(self) -> None:
        """Stop the codec's threads (idle ones; tests and tools)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

