"""``OpenedFile.pieces``: what a checksum pass streams (fsck, ``check_block``) is the file's bytes,
holes included as zeros, in one reused bounded buffer; a sparse block claiming gigabytes is
checked in about the time its allocated bytes take (a hole is not read), never tens of seconds."""

from __future__ import annotations

import errno
import os
import time

import pytest
import xxhash

from pykv.blockfile import check_block
from pykv.errors import ChecksumError
from pykv.format import HEADER_SIZE, BlockHeader, Geometry, encode_header
from pykv.io import safe_paths
from pykv.io.safe_paths import STREAM_PIECE, open_regular

MIB = 1 << 20


def sparse_file(path, size: int, extents: list[tuple[int, bytes]]) -> bytes:
    """A file of ``size`` bytes holding ``extents`` (offset, bytes), holes elsewhere; its bytes."""
    content = bytearray(size)
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in extents:
            f.seek(offset)
            f.write(data)
            content[offset:offset + len(data)] = data
    return bytes(content)


def streamed(path, length: int, offset: int) -> bytes:
    opened = open_regular(path)
    try:
        return b"".join(bytes(piece) for piece in opened.pieces(length, offset))
    finally:
        opened.close()


SHAPES = {
    "data, hole, data": (40 * MIB, [(0, os.urandom(3 * MIB)), (30 * MIB, os.urandom(MIB + 7))]),
    "hole first, hole last": (40 * MIB, [(20 * MIB, os.urandom(5 * MIB))]),
    "all hole": (20 * MIB, []),
    "all data": (3 * MIB + 5, [(0, os.urandom(3 * MIB + 5))]),
    "many small extents": (10 * MIB, [(i * 256 << 10, os.urandom(4096)) for i in range(40)]),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("holes", [True, False], ids=["seek-data", "no-hole-support"])
def test_the_stream_is_the_files_bytes(tmp_path, monkeypatch, shape, holes):
    size, extents = SHAPES[shape]
    content = sparse_file(tmp_path / "f", size, extents)
    if not holes:  # a file system that cannot tell holes: everything is read
        def no_seek_data(fd, position, how):
            raise OSError(errno.EINVAL, "not supported")
        monkeypatch.setattr(safe_paths.os, "lseek", no_seek_data)
    for offset, length in ((0, size), (4096, size - 4096), (7, 3 * MIB), (size - 100, 100), (0, size + 4096),
                           (size, 10), (size + 5, 10)):
        expected = content[offset:offset + length]
        assert streamed(tmp_path / "f", length, offset) == expected, (offset, length)


def test_pieces_are_views_of_one_bounded_buffer(tmp_path):
    sparse_file(tmp_path / "f", 30 * MIB, [(0, os.urandom(30 * MIB))])
    opened = open_regular(tmp_path / "f")
    try:
        owners = {id(piece.obj) for piece in opened.pieces(30 * MIB, 0)}
        assert len(owners) == 1
        assert max(len(piece) for piece in opened.pieces(30 * MIB, 0)) <= STREAM_PIECE
    finally:
        opened.close()


def sparse_block(path, payload_length: int, checksum: bytes) -> None:
    header = encode_header(BlockHeader(b"n" * 16, b"k" * 20, Geometry(256, 1, payload_length), checksum))
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(HEADER_SIZE + payload_length)


def test_a_sparse_block_claiming_gigabytes_is_checked_in_a_moment(tmp_path):
    length = 8 << 30
    sparse_block(tmp_path / "zeros.kv", length, bytes(16))  # a checksum the zeros do not have
    started = time.monotonic()
    with pytest.raises(ChecksumError):
        check_block(tmp_path / "zeros.kv")
    assert time.monotonic() - started < 10  # a full read of 8 GiB through fresh 64 MiB buffers took ~25 s


def test_a_sparse_block_whose_checksum_is_right_passes(tmp_path):
    length = (1 << 30) + 4096
    hasher = xxhash.xxh3_128()
    zeros = bytes(64 * MIB)
    for start in range(0, length, len(zeros)):
        hasher.update(zeros[:min(len(zeros), length - start)])
    sparse_block(tmp_path / "zeros.kv", length, hasher.digest())
    assert check_block(tmp_path / "zeros.kv").header.payload_length == length
