"""Synchronous block files: write, check, read (pykv/blockfile.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from pykv.blockfile import check_block, encode_block, read_header, read_payload, write_block
from pykv.errors import ChecksumError, FormatError
from pykv.format import HEADER_SIZE, Geometry, file_size
from pykv.namespace import Namespace
from pykv.tree import KVTree, is_temp_name

NS = Namespace(model="m", dtype="bfloat16", kv_layout="NHD", tokens_per_block=16)
KEY = bytes.fromhex("00112233445566778899aabbccddeeff")
GEOMETRY = Geometry(tokens=16, segments=4, segment_bytes=1500)  # 6000 bytes: not page aligned
PAYLOAD = bytes((i * 31 + 7) % 256 for i in range(GEOMETRY.payload_length))


@pytest.fixture
def tree(tmp_path: Path) -> KVTree:
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    return tree


@pytest.fixture
def block(tree: KVTree) -> Path:
    assert write_block(tree, NS.id, KEY, GEOMETRY, PAYLOAD) is True
    return tree.block_path(NS.id, KEY)


def test_write_then_check_round_trip(block):
    checked = check_block(block)
    assert checked.path == block
    assert checked.size == file_size(len(PAYLOAD)) == os.path.getsize(block) == HEADER_SIZE + 8192
    assert checked.header.namespace == NS.fingerprint
    assert checked.header.key == KEY
    assert checked.header.geometry == GEOMETRY
    assert read_header(block) == checked.header


def test_file_bytes_are_header_payload_and_zero_padding(block):
    data = block.read_bytes()
    assert data[HEADER_SIZE:HEADER_SIZE + len(PAYLOAD)] == PAYLOAD
    assert data[HEADER_SIZE + len(PAYLOAD):] == bytes(len(data) - HEADER_SIZE - len(PAYLOAD))


def test_encode_block_is_what_write_block_writes_apart_from_creation_time(block):
    encoded = encode_block(NS.fingerprint, KEY, GEOMETRY, PAYLOAD)
    data = block.read_bytes()
    assert len(encoded) == len(data)
    assert encoded[HEADER_SIZE:] == data[HEADER_SIZE:]
    assert encoded[:144] == data[:144]  # everything before created_ns


def test_read_payload_returns_the_payload(block):
    header, payload = read_payload(block)
    assert payload == PAYLOAD
    assert header.key == KEY
    assert read_payload(block, verify=False)[1] == PAYLOAD


def test_second_write_of_same_key_loses_and_leaves_no_temp(tree, block):
    before = block.read_bytes()
    assert write_block(tree, NS.id, KEY, GEOMETRY, bytes(len(PAYLOAD))) is False
    assert block.read_bytes() == before
    assert [p.name for p in block.parent.iterdir()] == [block.name]
    assert not any(is_temp_name(p.name) for p in tree.root.rglob("*"))


def test_write_block_survives_short_writes(tree, monkeypatch):
    real_write = os.write

    def short_write(fd, data):  # what a signal or a nearly full disk can do
        return real_write(fd, bytes(memoryview(data)[:1000]))

    monkeypatch.setattr(os, "write", short_write)
    assert write_block(tree, NS.id, KEY, GEOMETRY, PAYLOAD) is True
    monkeypatch.undo()
    checked = check_block(tree.block_path(NS.id, KEY))
    assert checked.size == file_size(len(PAYLOAD))


def test_write_block_with_fsync_option(tmp_path):
    from pykv.tree import TreeOptions
    tree = KVTree.create(tmp_path / "tree", TreeOptions(fsync=True))
    tree.ensure_namespace(NS)
    assert write_block(tree, NS.id, KEY, GEOMETRY, PAYLOAD) is True
    check_block(tree.block_path(NS.id, KEY))


def test_empty_payload_is_a_header_only_file(tree):
    geometry = Geometry(tokens=0, segments=0, segment_bytes=0)
    assert write_block(tree, NS.id, KEY, geometry, b"") is True
    path = tree.block_path(NS.id, KEY)
    assert check_block(path).size == HEADER_SIZE
    assert read_payload(path)[1] == b""


@pytest.mark.parametrize("cut", [1, 4096, 8191, 8192 + 4096 - 1])
def test_truncated_file(block, cut):
    size = os.path.getsize(block)
    os.truncate(block, size - cut)
    with pytest.raises(FormatError, match="truncated") as info:
        check_block(block)
    assert not isinstance(info.value, ChecksumError)
    assert str(block) in str(info.value)


@pytest.mark.parametrize("extra", [1, 4096])
def test_oversized_file(block, extra):
    with open(block, "ab") as f:
        f.write(b"\0" * extra)
    with pytest.raises(FormatError, match="oversized") as info:
        check_block(block)
    assert str(block) in str(info.value)


def test_payload_bit_flip_fails_full_check_only(block):
    with open(block, "r+b") as f:
        f.seek(HEADER_SIZE + 4321)
        byte = f.read(1)[0]
        f.seek(HEADER_SIZE + 4321)
        f.write(bytes([byte ^ 0x04]))
    with pytest.raises(ChecksumError, match="payload checksum") as info:
        check_block(block, full=True)
    assert info.value.path == block
    assert check_block(block, full=False).header.key == KEY
    with pytest.raises(ChecksumError):
        read_payload(block)
    assert read_payload(block, verify=False)[1] != PAYLOAD


def test_bit_flip_in_padding_is_not_a_checksum_error(block):
    with open(block, "r+b") as f:
        f.seek(os.path.getsize(block) - 1)
        f.write(b"\x01")
    check_block(block, full=True)


def test_header_bit_flip_fails_even_the_quick_check(block):
    with open(block, "r+b") as f:
        f.seek(112)
        byte = f.read(1)[0]
        f.seek(112)
        f.write(bytes([byte ^ 0x01]))
    with pytest.raises(ChecksumError, match="header checksum"):
        check_block(block, full=False)
    with pytest.raises(ChecksumError):
        read_header(block)


def test_read_payload_without_verify_still_refuses_a_short_payload(block):
    os.truncate(block, HEADER_SIZE + 10)
    with pytest.raises(FormatError, match="truncated"):
        read_payload(block, verify=False)


@pytest.mark.parametrize("reader", [check_block, read_payload, read_header])
def test_symlink_at_the_path_is_refused(tree, block, tmp_path, reader):
    link = tree.block_path(NS.id, bytes.fromhex("ff" * 16))
    tree.ensure_parent(link)
    link.symlink_to(block)
    with pytest.raises(OSError) as info:
        reader(link)
    assert info.value.errno == errno.ELOOP


def test_write_block_refuses_to_follow_a_symlink_planted_at_the_temp_name(tree, tmp_path, monkeypatch):
    final = tree.block_path(NS.id, KEY)
    planted = final.with_name(final.name + ".tmp.planted")
    tree.ensure_parent(final)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    planted.symlink_to(victim)
    monkeypatch.setattr(tree, "temp_path", lambda final: planted)
    with pytest.raises(FileExistsError):
        write_block(tree, NS.id, KEY, GEOMETRY, PAYLOAD)
    assert victim.read_bytes() == b"keep me"
    assert not final.exists()
