"""Synchronous reading and writing of single block files (CLI, tests, tools).

The serving path moves blocks through the reactor instead; both use the same
header functions from ``pykv.format`` and the same publication from ``pykv.tree``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pykv.errors import FormatError
from pykv.format import HEADER_SIZE, BlockHeader, Geometry, build_header, decode_header, encode_header, padded, verify_payload
from pykv.tree import KVTree

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def read_header(path: Path) -> BlockHeader:
    """Parse the header of ``path`` (symlinks refused); raise ``FormatError`` if bad."""
    fd = os.open(path, _READ_FLAGS)
    try:
        data = os.pread(fd, HEADER_SIZE, 0)
    finally:
        os.close(fd)
    return decode_header(data, path=path)


@dataclass(frozen=True)
class CheckedBlock:
    """A block file that passed the checks asked for."""

    path: Path
    header: BlockHeader
    size: int


def check_block(path: Path, *, full: bool = True) -> CheckedBlock:
    """Check header, exact file size and (if ``full``) the payload checksum."""
    fd = os.open(path, _READ_FLAGS)
    try:
        size = os.fstat(fd).st_size
        header = decode_header(os.pread(fd, HEADER_SIZE, 0), path=path)
        if size != header.file_size:
            kind = "truncated" if size < header.file_size else "oversized"
            raise FormatError(path, f"{kind}: {size} bytes, header says {header.file_size}")
        if full:
            payload = os.pread(fd, header.payload_length, HEADER_SIZE)
            verify_payload(header, payload, path=path)
    finally:
        os.close(fd)
    return CheckedBlock(path, header, size)


def read_payload(path: Path, *, verify: bool = True) -> tuple[BlockHeader, bytes]:
    """Header and payload bytes of ``path`` (checked against the header when ``verify``)."""
    fd = os.open(path, _READ_FLAGS)
    try:
        header = decode_header(os.pread(fd, HEADER_SIZE, 0), path=path)
        payload = os.pread(fd, header.payload_length, HEADER_SIZE)
    finally:
        os.close(fd)
    if verify:
        verify_payload(header, payload, path=path)
    elif len(payload) < header.payload_length:
        raise FormatError(path, f"payload truncated: {len(payload)} of {header.payload_length} bytes")
    return header, payload


def encode_block(namespace: bytes, key: bytes, geometry: Geometry, payload: bytes | memoryview) -> bytes:
    """Header, payload and zero padding: the exact bytes of a v1 file."""
    header = build_header(namespace, key, geometry, payload)
    encoded = encode_header(header)
    assert encoded is not None
    return encoded + bytes(payload) + bytes(padded(len(payload)) - len(payload))


def write_block(tree: KVTree, namespace_id: str, key: bytes, geometry: Geometry,
                payload: bytes | memoryview) -> bool:
    """Write and publish one block with buffered I/O. False if it already existed."""
    final = tree.block_path(namespace_id, key)
    tree.ensure_parent(final)
    temp = tree.temp_path(final)
    data = encode_block(bytes.fromhex(namespace_id), key, geometry, payload)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, tree.options.file_mode)
    try:
        remaining = memoryview(data)
        while remaining:  # os.write may write less than asked (signal, nearly full disk)
            remaining = remaining[os.write(fd, remaining):]
        if tree.options.fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    os.close(fd)
    return tree.publish(temp, final)
