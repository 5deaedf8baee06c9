"""Synchronous reading and writing of single block files (CLI, tests, tools).

The serving path moves blocks through the reactor instead; both use the same
header functions from ``pykv.format`` and the same publication from ``pykv.tree``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import xxhash

from pykv.auth import AuthStatus, KeyRing, sign, verdict
from pykv.codec.base import Codec
from pykv.errors import ChecksumError, FormatError
from pykv.io.safe_paths import OpenedFile, open_beneath, open_regular, relative_to, unlink_beneath
from pykv.format import (HEADER_SIZE, BlockHeader, Geometry, TruncatedError, build_header, check_file_size, decode_header,
                         encode_header, padded, verify_payload)
from pykv.format_codec import NONE
from pykv.tree import KVTree

#: The largest block file pykv reads (header-validated and equal to the file's size first): far
#: above any real block (a 256-token block of a 405B model is ~126 MiB per rank), far below memory.
MAX_BLOCK_FILE = 16 << 30


def _open_block(path: Path) -> OpenedFile:
    """A regular block file opened without blocking, link-following or atime change
    (``pykv.io.safe_paths.open_regular``)."""
    return open_regular(path)


def _header_of(opened: OpenedFile, path: Path, head: bytes | None = None) -> BlockHeader:
    """The header (``head``: its bytes, if read already), checked against the file: its length
    must be the file's exact size."""
    header = decode_header(opened.read(HEADER_SIZE, 0) if head is None else head, path=path)
    check_file_size(path, opened.size, header)
    if header.file_size > MAX_BLOCK_FILE:
        raise FormatError(path, f"header claims {header.file_size} bytes, more than the {MAX_BLOCK_FILE} "
                                "a block may hold")
    return header


def read_header(path: Path) -> BlockHeader:
    """Parse the header of ``path`` (symlinks and non-regular files refused); raise ``FormatError``
    if bad. The file's size is not compared (``check_block`` does)."""
    with _open_block(path) as opened:
        return decode_header(opened.read(HEADER_SIZE, 0), path=path)


def signed_with(path: Path, keys: KeyRing) -> bool:
    """Whether the block at ``path`` is signed with a key id of ``keys`` (header only: a load checks
    the MAC); False for an unsigned, unreadable or damaged file."""
    try:
        return keys.holds(read_header(path))
    except (FormatError, OSError):
        return False


@dataclass(frozen=True)
class CheckedBlock:
    """A block file that passed the checks asked for."""

    path: Path
    header: BlockHeader
    size: int
    auth: AuthStatus | None = None  # what the key ring says (``check_block(keys=...)``)


def check_block(path: Path, *, full: bool = True, keys: KeyRing | None = None) -> CheckedBlock:
    """Check header, exact file size and (if ``full``) the payload checksum, streamed in bounded
    pieces (nothing is allocated from the header's length). ``keys``: also hash the MAC in the same
    pass and report the ring's ``AuthStatus`` (a refused block is reported, not raised)."""
    with _open_block(path) as opened:
        head = opened.read(HEADER_SIZE, 0)
        header = _header_of(opened, path, head)
        auth = keys.hasher(header, head) if keys is not None else None
        if full or keys is not None:
            hasher = xxhash.xxh3_128() if full else None
            done = 0
            for piece in opened.pieces(header.payload_length, HEADER_SIZE):
                if hasher is not None:
                    hasher.update(piece)
                if auth is not None and not isinstance(auth, AuthStatus):
                    auth.update(piece)
                done += len(piece)
            if done < header.payload_length:  # cut while it was read
                raise TruncatedError(path, HEADER_SIZE + done, header.file_size)
            if hasher is not None and hasher.digest() != header.payload_checksum:
                raise ChecksumError(path, "payload checksum mismatch")
        return CheckedBlock(path, header, opened.size, None if auth is None else verdict(auth, header))


def read_payload(path: Path, *, verify: bool = True) -> tuple[BlockHeader, bytes]:
    """Header and payload bytes of ``path`` (checked against the header when ``verify``). The
    payload is allocated only once the header's length matched the file's size."""
    with _open_block(path) as opened:
        header = _header_of(opened, path)
        payload = opened.read(header.payload_length, HEADER_SIZE)
    if verify:
        verify_payload(header, payload, path=path)
    elif len(payload) < header.payload_length:
        raise TruncatedError(path, HEADER_SIZE + len(payload), header.file_size)
    return header, payload


def encode_block(namespace: bytes, key: bytes, geometry: Geometry, payload: bytes | memoryview, *,
                 keys: KeyRing | None = None, codec: Codec | None = None) -> bytes:
    """Header, payload and zero padding: the exact bytes of a block file (signed with ``keys``'s write key;
    the raw ``payload`` stored as ``codec`` encodes it, a coded block unless the codec is ``none``)."""
    params = NONE
    if codec is not None and codec.params != NONE:
        params, payload = codec.params, codec.encode(payload)  # type: ignore[assignment]  # bytes: no ``out``
    header = build_header(namespace, key, geometry, payload, key_id=keys.write_id if keys is not None else b"",
                          codec=params)
    encoded = encode_header(header)
    assert encoded is not None
    if keys is not None:
        encoded = bytearray(encoded)
        sign(keys, encoded, payload)
    return bytes(encoded) + bytes(payload) + bytes(padded(len(payload)) - len(payload))


def write_block(tree: KVTree, namespace_id: str, key: bytes, geometry: Geometry,
                payload: bytes | memoryview, *, keys: KeyRing | None = None, codec: Codec | None = None) -> bool:
    """Write and publish one block with buffered I/O (signed with ``keys``, stored by ``codec``). False if
    it already existed."""
    final = tree.block_path(namespace_id, key)
    tree.ensure_parent(final)
    temp = tree.temp_path(final)
    data = encode_block(bytes.fromhex(namespace_id), key, geometry, payload, keys=keys, codec=codec)
    relative = relative_to(tree.root, temp)
    fd = open_beneath(tree.root, relative, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, tree.options.file_mode)
    try:
        remaining = memoryview(data)
        while remaining:  # os.write may write less than asked (signal, nearly full disk)
            remaining = remaining[os.write(fd, remaining):]
        if tree.options.fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_beneath(tree.root, relative)
        raise
    os.close(fd)
    return tree.publish(temp, final)
