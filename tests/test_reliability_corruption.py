"""Corruption: every kind of damage to a block file is detected, on load and by fsck, and is a miss.

Exhaustively in memory (every single-bit flip of a header and of a payload), then
on real files through the reactor with both I/O backends (the engine's load path),
``check_block`` and ``fsck``/``repair``. The end-to-end proof with real engines
(output equal to recompute, files quarantined) is ``test_reliability_e2e.py``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from pykv.blockfile import check_block, encode_block, write_block
from pykv.errors import FormatError
from pykv.format import HEADER_SIZE, Geometry, build_header, decode_header, encode_header, verify_payload
from pykv.maintenance import fsck, repair

from reliability.rig import MISS, NS, OTHER_NS, Rig, geometry_of, key_of, payload_of

GEOMETRY = Geometry(tokens=256, segments=2, segment_bytes=6000)  # 12,000-byte payload, 16 KiB files
FILE_SIZE = HEADER_SIZE + 12288


def test_every_single_bit_flip_of_a_header_is_rejected():
    header = build_header(NS.fingerprint, key_of(0), GEOMETRY, payload_of(key_of(0), GEOMETRY.payload_length))
    data = bytearray(encode_header(header))
    assert decode_header(bytes(data)) == header
    missed = []
    for bit in range(HEADER_SIZE * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        try:
            decode_header(bytes(data))
            missed.append(bit)
        except FormatError:
            pass
        data[bit // 8] ^= 1 << (bit % 8)
    assert missed == []


def test_every_single_bit_flip_of_a_payload_is_rejected():
    payload = bytearray(payload_of(key_of(1), 4000))
    header = build_header(NS.fingerprint, key_of(1), Geometry(256, 1, 4000), payload)
    verify_payload(header, payload)
    missed = []
    for bit in range(len(payload) * 8):
        payload[bit // 8] ^= 1 << (bit % 8)
        try:
            verify_payload(header, payload)
            missed.append(bit)
        except FormatError:
            pass
        payload[bit // 8] ^= 1 << (bit % 8)
    assert missed == []


# -- damage to real files ------------------------------------------------------------------------

def flip(offset: int) -> Callable[[Path, Rig], None]:
    def damage(path: Path, rig: Rig) -> None:
        with open(path, "r+b") as f:
            f.seek(offset if offset >= 0 else os.path.getsize(path) + offset)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))
    return damage


def truncate(size: int) -> Callable[[Path, Rig], None]:
    def damage(path: Path, rig: Rig) -> None:
        os.truncate(path, size if size >= 0 else os.path.getsize(path) + size)
    return damage


def extend(extra: int) -> Callable[[Path, Rig], None]:
    def damage(path: Path, rig: Rig) -> None:
        with open(path, "ab") as f:
            f.write(bytes(extra))
    return damage


def copied_from_other_key(path: Path, rig: Rig) -> None:
    shutil.copyfile(rig.path(key_of(0)), path)  # a sound block, under another hash's name


def from_other_namespace(path: Path, rig: Rig) -> None:
    """The same key's block as another namespace (another dtype) writes it, put in this one's place."""
    key = bytes.fromhex(path.name[:-3])
    rig.tree.ensure_namespace(OTHER_NS)
    write_block(rig.tree, OTHER_NS.id, key, GEOMETRY, payload_of(key, GEOMETRY.payload_length))
    shutil.copyfile(rig.tree.block_path(OTHER_NS.id, key), path)


def spliced(path: Path, rig: Rig) -> None:
    """This block's header in front of another block's payload of the same length."""
    other = rig.path(key_of(0)).read_bytes()
    data = path.read_bytes()
    path.write_bytes(data[:HEADER_SIZE] + other[HEADER_SIZE:])


def pickle_file(path: Path, rig: Rig) -> None:
    import pickle
    path.write_bytes(pickle.dumps({"not": "a block"}) * 1000)


def random_bytes(path: Path, rig: Rig) -> None:
    path.write_bytes(os.urandom(os.path.getsize(path)))


DAMAGE = {  # name -> (damage, fsck's class)
    "header-magic": (flip(0), "bad-header"),
    "header-version": (flip(8), "bad-header"),
    "header-flags": (flip(12), "bad-header"),
    "header-namespace": (flip(20), "bad-header"),
    "header-key-length": (flip(32), "bad-header"),
    "header-reserved": (flip(36), "bad-header"),
    "header-key": (flip(50), "bad-header"),
    "header-payload-length": (flip(105), "bad-header"),
    "header-tokens": (flip(113), "bad-header"),
    "header-segments": (flip(116), "bad-header"),
    "header-segment-bytes": (flip(121), "bad-header"),
    "header-payload-checksum": (flip(130), "bad-header"),
    "header-created": (flip(150), "bad-header"),
    "header-checksum": (flip(155), "bad-header"),
    "header-zero-area": (flip(2000), "bad-header"),
    "header-last-byte": (flip(HEADER_SIZE - 1), "bad-header"),
    "payload-first-byte": (flip(HEADER_SIZE), "bad-checksum"),
    "payload-middle": (flip(HEADER_SIZE + 6000), "bad-checksum"),
    "payload-last-byte": (flip(HEADER_SIZE + 11999), "bad-checksum"),
    "zero-length": (truncate(0), "truncated"),
    "truncated-in-header": (truncate(100), "truncated"),
    "truncated-to-header": (truncate(HEADER_SIZE), "truncated"),
    "truncated-in-payload": (truncate(HEADER_SIZE + 4096), "truncated"),
    "truncated-by-one-byte": (truncate(-1), "truncated"),
    "oversized-by-one-byte": (extend(1), "oversized"),
    "oversized-by-a-page": (extend(4096), "oversized"),
    "copied-under-another-hash": (copied_from_other_key, "misplaced"),
    "from-another-namespace": (from_other_namespace, "misplaced"),
    "spliced-payload": (spliced, "bad-checksum"),
    "pickle-instead-of-block": (pickle_file, "bad-header"),
    "random-bytes": (random_bytes, "bad-header"),
}


@pytest.mark.parametrize("backend", ["io_uring", "threadpool"])
@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_block_is_a_failed_load_an_fsck_finding_and_then_a_miss(tmp_path, backend, name):
    damage, problem = DAMAGE[name]
    keys = [key_of(i) for i in range(3)]
    with Rig(tmp_path / "tree", backend=backend) as rig:
        assert rig.store(keys, [GEOMETRY] * 3).result.ok
        victim = rig.path(keys[1])
        damage(victim, rig)

        loaded = rig.load(keys, [GEOMETRY] * 3)
        assert list(loaded.result.failed) == [1], loaded.result.failed  # only the damaged block fails ...
        assert sorted(loaded.delivered) == [0, 2] and not loaded.mismatched  # ... and never reaches the sink
        assert loaded.result.failed[1].corrupt and not str(loaded.result.failed[1]).endswith(MISS)

        if problem == "misplaced":  # a sound file, but not this name's block
            header = check_block(victim, full=True).header
            assert (header.namespace, header.key) != (NS.fingerprint, keys[1])
        else:
            with pytest.raises((FormatError, OSError)):
                check_block(victim, full=True)
        report = fsck(rig.tree, grace_s=0)
        assert [(f.path, f.problem.value) for f in report.findings] == [
            (os.path.relpath(victim, rig.tree.root), problem)]
        repair(rig.tree, report)
        assert report.clean and not victim.exists()
        assert len(list((rig.tree.state_dir / "quarantine").rglob("*.kv"))) == 1

        again = rig.load(keys, [GEOMETRY] * 3)
        assert list(again.result.failed) == [1] and str(again.result.failed[1]).endswith(MISS)
        assert not again.result.failed[1].corrupt  # a miss: nothing left to quarantine
        assert fsck(rig.tree, grace_s=0).clean


@pytest.mark.parametrize("backend", ["io_uring", "threadpool"])
def test_a_sound_block_of_another_geometry_is_refused_on_load(tmp_path, backend):
    """Written by an engine with another storage block size or page size: the header's geometry
    differs from the one the loading engine expects."""
    key = key_of(7)
    with Rig(tmp_path / "tree", backend=backend) as rig:
        other = Geometry(tokens=512, segments=2, segment_bytes=6000)
        write_block(rig.tree, NS.id, key, other, payload_of(key, other.payload_length))
        loaded = rig.load([key], [GEOMETRY])
        assert "geometry" in str(loaded.result.failed[0]) and loaded.result.failed[0].corrupt and not loaded.delivered


def test_verify_header_only_is_the_documented_exception(tmp_path):
    """The control: with verify=header a payload flip is delivered (what full verification prevents)."""
    key = key_of(3)
    with Rig(tmp_path / "tree", verify="header") as rig:
        rig.store([key], [GEOMETRY])
        flip(HEADER_SIZE + 10)(rig.path(key), rig)
        loaded = rig.load([key], [GEOMETRY])
        assert loaded.result.ok and loaded.mismatched == [0]
        flip(40)(rig.path(key), rig)  # a header flip is still caught
        assert not rig.load([key], [GEOMETRY]).result.ok


def test_geometry_of_rig_keys_is_what_the_files_hold(tmp_path):
    """The rig's own bookkeeping (used by the crash and soak runs) matches the files it writes."""
    key = key_of(11)
    geometry = geometry_of(key, 3000, 40000)
    with Rig(tmp_path / "tree") as rig:
        rig.store([key], [geometry])
        data = rig.path(key).read_bytes()
    want = encode_block(NS.fingerprint, key, geometry, payload_of(key, geometry.payload_length))
    assert data[:144] == want[:144] and data[160:] == want[160:]
