"""Authenticated blocks (pykv/auth.py): the key file, the MAC, header v2, and a BlockStore with a key
that refuses every block without a valid MAC (a miss, counted, quarantined) and signs every store."""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from pathlib import Path

import blake3
import pytest
import xxhash
from treefactory import NS as TREE_NS, add_block, key, make_tree
from typer.testing import CliRunner

from pykv.auth import AuthStatus, KeyFileError, KeyRing, check, load_key_ring, sign, write_key_file
from pykv.blockfile import check_block, read_header, signed_with, write_block
from pykv.commands.app import app
from pykv.config import PykvConfig
from pykv.errors import InputError
from pykv.failures import Step
from pykv.format import HEADER_SIZE, MAC_FIELD, SIGNED_VERSION, Geometry, decode_header
from pykv.jobledger import JobEnd
from pykv.namespace import Namespace
from pykv.staging import slot_bytes_for
from pykv.store import BlockRef, BlockStore, EngineShape
from pykv.tree import KVTree

KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))
KEY_X = bytes(range(200, 232))  # an attacker's key
GEOMETRY = Geometry(tokens=64, segments=2, segment_bytes=4096)
NS = Namespace("tiny", "bf16", "test", 64)
KEYS = [bytes([9, i]) * 16 for i in range(3)]


def key_file(tmp_path: Path, name: str, keys: dict[str, bytes]) -> Path:
    path = tmp_path / name
    write_key_file(path, keys)
    return path


def ring(tmp_path: Path, name: str, keys: dict[str, bytes]) -> KeyRing:
    return load_key_ring(key_file(tmp_path, name, keys))


def payload(block_key: bytes) -> bytes:
    return (block_key * (GEOMETRY.payload_length // len(block_key) + 1))[:GEOMETRY.payload_length]


def forge_bad_mac(path: Path) -> None:
    """Change a payload byte of a signed file and make both xxh3 checksums match again."""
    data = bytearray(path.read_bytes())
    header = decode_header(data)
    data[HEADER_SIZE + 7] ^= 0xFF
    data[128:144] = xxhash.xxh3_128_digest(bytes(data[HEADER_SIZE:HEADER_SIZE + header.payload_length]))
    struct.pack_into("<Q", data, 152, xxhash.xxh3_64_intdigest(bytes(data[:152])))
    path.write_bytes(bytes(data))
    assert check_block(path).header.payload_checksum == bytes(data[128:144])  # xxh3 sound


# -- the key file --------------------------------------------------------------------------------

def test_the_first_key_signs_and_every_key_verifies(tmp_path):
    keys = ring(tmp_path, "keys", {"2026-12": KEY_B, "2026-06": KEY_A})
    assert keys.write_id == b"2026-12" and keys.key_ids == ("2026-12", "2026-06")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_key_file_others_may_read_is_refused(tmp_path, mode):
    path = key_file(tmp_path, "keys", {"k1": KEY_A})
    os.chmod(path, mode)
    with pytest.raises(KeyFileError, match=f"mode {mode:04o} lets group or others read it") as info:
        load_key_ring(path)
    assert KEY_A.hex() not in str(info.value) and str(path) in str(info.value)
    os.chmod(path, 0o400)
    assert load_key_ring(path).key_ids == ("k1",)


@pytest.mark.parametrize("text, reason", [
    ("", "no key"),
    ("# only a comment\n\n", "no key"),
    (f"k1 {KEY_A.hex()[:-2]}\n", "line 1: key k1 is not 64 hex digits"),
    (f"k1 {KEY_A.hex()[:-1]}z\n", "line 1: key k1 is not 64 hex digits"),
    ("k1\n", "line 1: expected KEY_ID HEX"),
    (f"k/1 {KEY_A.hex()}\n", "line 1: expected KEY_ID HEX"),
    (f"{'k' * 17} {KEY_A.hex()}\n", "line 1: expected KEY_ID HEX"),
    (f"k1 {KEY_A.hex()} extra\n", "line 1: expected KEY_ID HEX"),
    (f"k1 {KEY_A.hex()}\n# c\nk1 {KEY_B.hex()}\n", "line 3: key id k1 given twice"),
])
def test_a_malformed_key_file_is_refused_naming_the_line_never_the_key(tmp_path, text, reason):
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(KeyFileError, match=reason) as info:
        load_key_ring(path)
    message = str(info.value)
    assert message.startswith(f"kv_connector_extra_config.auth_key_file {path}: ")
    assert KEY_A.hex()[:40] not in message and KEY_B.hex()[:40] not in message


def test_a_missing_key_file_or_a_directory_is_refused(tmp_path):
    with pytest.raises(KeyFileError, match="cannot open"):
        load_key_ring(tmp_path / "absent")
    (tmp_path / "dir").mkdir(mode=0o700)
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_key_ring(tmp_path / "dir")


def test_the_key_bytes_appear_in_no_repr_and_no_config_output(tmp_path):
    path = key_file(tmp_path, "keys", {"k1": KEY_A, "k0": KEY_B})
    keys = load_key_ring(path)
    assert repr(keys) == f"KeyRing({str(path)!r}, write='k1', read=['k1', 'k0'])" and str(keys) == repr(keys)
    (tmp_path / "tree").mkdir()
    config = PykvConfig.from_extra_config({"root": str(tmp_path / "tree"), "auth_key_file": str(path)})
    result = CliRunner().invoke(app, ["config", "--root", str(tmp_path / "tree"), "--set", f"auth_key_file={path}"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["kv_connector_extra_config"]["auth_key_file"] == str(path)
    for text in (repr(keys), repr(config), json.dumps(config.to_extra_config()), result.output):
        assert KEY_A.hex() not in text and KEY_B.hex() not in text


# -- the MAC ---------------------------------------------------------------------------------------

def signed_file(tmp_path: Path, keys: KeyRing) -> Path:
    tree = make_tree(tmp_path)
    return add_block(tree, key(1), keys=keys)


def test_the_mac_is_the_same_on_any_number_of_hashing_threads(tmp_path):
    keys = ring(tmp_path, "keys", {"k1": KEY_A})
    head = bytearray(HEADER_SIZE)
    head[:4] = b"head"
    data = os.urandom(3 << 20)  # several of BLAKE3's chunk groups, so a pool has work to split
    macs = {threads: sign(keys.with_hash_threads(threads), bytearray(head), data) for threads in (0, 1, 2, 7)}
    assert len(set(macs.values())) == 1
    assert keys.with_hash_threads(0).hash_threads == blake3.blake3.AUTO


@pytest.mark.parametrize("value", [-1, 65, "x", True])
def test_mac_threads_is_bounded(value):
    with pytest.raises(InputError, match="mac_threads: expected an integer from 0 to 64"):
        PykvConfig.from_extra_config({"root": "/r", "mac_threads": value})
    assert PykvConfig.from_extra_config({"root": "/r", "mac_threads": "0"}).mac_threads == 0


def test_a_signed_block_is_header_v2_with_the_write_key_id_and_verifies(tmp_path):
    keys = ring(tmp_path, "keys", {"k1": KEY_A})
    path = signed_file(tmp_path, keys)
    data = path.read_bytes()
    header = read_header(path)
    assert struct.unpack_from("<HHI", data, 8) == (SIGNED_VERSION, HEADER_SIZE, 0)  # v1 readers refuse version 2
    assert header.key_id == b"k1" and header.mac == data[MAC_FIELD] and any(header.mac)
    assert check(keys, header, data[:HEADER_SIZE], data[HEADER_SIZE:]) is AuthStatus.VALID
    assert check_block(path, keys=keys).auth is AuthStatus.VALID
    assert check_block(path).auth is None  # a reader without a key checks the xxh3 checksums only


def test_every_header_field_and_the_payload_are_under_the_mac(tmp_path):
    keys = ring(tmp_path, "keys", {"k1": KEY_A})
    data = signed_file(tmp_path, keys).read_bytes()
    for offset in (16, 40, 112, 144):  # namespace, block key, tokens, creation time
        forged = bytearray(data)
        forged[offset] ^= 1
        struct.pack_into("<Q", forged, 152, xxhash.xxh3_64_intdigest(bytes(forged[:152])))
        header = decode_header(forged)
        assert check(keys, header, forged, forged[HEADER_SIZE:]) is AuthStatus.BAD_MAC, offset
    header = decode_header(data)
    flipped = bytes([data[HEADER_SIZE] ^ 1]) + data[HEADER_SIZE + 1:]
    assert check(keys, header, data, flipped) is AuthStatus.BAD_MAC


def test_unsigned_and_foreign_key_blocks_are_refused_without_hashing(tmp_path):
    keys = ring(tmp_path, "keys", {"k1": KEY_A})
    tree = make_tree(tmp_path)
    unsigned = add_block(tree, key(1))
    foreign = add_block(tree, key(2), keys=ring(tmp_path, "other", {"x": KEY_X}))
    assert check_block(unsigned, keys=keys).auth is AuthStatus.UNSIGNED
    assert check_block(foreign, keys=keys).auth is AuthStatus.UNKNOWN_KEY
    impostor = add_block(tree, key(3), keys=ring(tmp_path, "impostor", {"k1": KEY_X}))  # the right id, another key
    assert check_block(impostor, keys=keys).auth is AuthStatus.BAD_MAC


def test_signed_with_tells_blocks_of_the_rings_key_ids_from_the_rest(tmp_path):
    keys = ring(tmp_path, "keys", {"k1": KEY_A})
    tree = make_tree(tmp_path)
    assert signed_with(add_block(tree, key(1), keys=keys), keys)
    assert not signed_with(add_block(tree, key(2)), keys)
    assert not signed_with(add_block(tree, key(3), keys=ring(tmp_path, "other", {"x": KEY_X})), keys)
    (tmp_path / "junk.kv").write_bytes(b"not a block")
    assert not signed_with(tmp_path / "junk.kv", keys) and not signed_with(tmp_path / "absent.kv", keys)


# -- a BlockStore with a key -----------------------------------------------------------------------

class Client:
    """Copies payloads between a dict of blocks and the slots; collects every job's end."""

    def __init__(self) -> None:
        self.store: BlockStore | None = None
        self.loaded: dict[bytes, bytes] = {}
        self.ends: dict[object, JobEnd] = {}
        self.jobs: dict[object, list[bytes]] = {}
        self.done = threading.Condition()

    def to_slots(self, copies, done):
        for c in copies:
            self.store.pool.view(c.slot)[HEADER_SIZE:HEADER_SIZE + c.length] = payload(self.jobs[c.job][c.index])
            done(c, True)

    def from_slots(self, copies, done):
        for c in copies:
            block = bytes(self.store.pool.view(c.slot)[HEADER_SIZE:HEADER_SIZE + c.length])
            self.loaded[self.jobs[c.job][c.index]] = block
            done(c, True)

    def job_ended(self, end: JobEnd) -> None:
        with self.done:
            self.ends[end.job] = end
            self.done.notify_all()

    def store_released(self, release) -> None:
        pass

    def run(self, job, keys, *, load: bool) -> JobEnd:
        self.jobs[job] = list(keys)
        refs = [BlockRef(k, GEOMETRY) for k in keys]
        self.store.load_blocks(job, refs) if load else self.store.store_blocks(job, refs)
        with self.done:
            assert self.done.wait_for(lambda: job in self.ends, timeout=20), f"job {job} did not end"
            return self.ends[job]


@pytest.fixture
def engine(tmp_path):
    made = []

    def make(key_path: Path | None, **extra) -> Client:
        (tmp_path / "tree").mkdir(exist_ok=True)  # as `pykv init` makes it: engines never create a root
        settings = {"root": str(tmp_path / "tree"), "io_engine": "threadpool", **extra}
        if key_path is not None:
            settings["auth_key_file"] = str(key_path)
        client = Client()
        shape = EngineShape(NS, slot_bytes_for(GEOMETRY.payload_length), 4)
        client.store = BlockStore(PykvConfig.from_extra_config(settings), shape, client)
        made.append(client.store)
        return client
    yield make
    for store in made:
        store.close()


def block_path(client: Client, block_key: bytes) -> Path:
    return client.store.devices[0].block_path(NS.id, block_key)


def plant(client: Client, block_key: bytes, keys: KeyRing | None) -> Path:
    tree: KVTree = client.store.devices[0]
    assert write_block(tree, NS.id, block_key, GEOMETRY, payload(block_key), keys=keys)
    return block_path(client, block_key)


@pytest.mark.parametrize("mac_threads", [0, 1, 3])
def test_an_engine_with_a_key_signs_what_it_stores_and_loads_it(tmp_path, engine, mac_threads):
    keys = key_file(tmp_path, "keys", {"k1": KEY_A})
    writer = engine(keys, mac_threads=mac_threads)
    assert writer.store.reactor.keys.hash_threads == (mac_threads or blake3.blake3.AUTO)
    assert not writer.run(1, KEYS, load=False).failures
    for k in KEYS:
        header = read_header(block_path(writer, k))
        assert header.key_id == b"k1" and check_block(block_path(writer, k), keys=load_key_ring(keys)).auth \
            is AuthStatus.VALID
    end = writer.run(2, KEYS, load=True)
    assert not end.failures and writer.loaded == {k: payload(k) for k in KEYS}
    assert writer.store.stats().get("load_blocks_unauthenticated", 0) == 0


@pytest.mark.parametrize("verify", ["full", "header"])
@pytest.mark.parametrize("forgery", ["unsigned", "foreign key id", "wrong MAC", "valid xxh3, bad MAC"])
def test_a_forged_block_is_never_loaded_counted_and_quarantined(tmp_path, engine, forgery, verify, caplog):
    keys = key_file(tmp_path, "keys", {"k1": KEY_A})
    client = engine(keys, verify=verify)
    client.run(1, KEYS[:1], load=False)  # a genuine block beside the forged one
    forged = KEYS[1]
    if forgery == "unsigned":
        path = plant(client, forged, None)
    elif forgery == "foreign key id":
        path = plant(client, forged, ring(tmp_path, "attacker", {"x": KEY_X}))
    elif forgery == "wrong MAC":
        path = plant(client, forged, ring(tmp_path, "attacker", {"k1": KEY_X}))
    else:
        path = plant(client, forged, load_key_ring(keys))
        forge_bad_mac(path)
    check_block(path)  # its xxh3 checksums are valid: only the MAC tells
    with caplog.at_level(logging.DEBUG):
        end = client.run(2, KEYS[:2], load=True)
    assert set(end.failures) == {1} and end.failures[1].step is Step.AUTH
    assert forged not in client.loaded and client.loaded[KEYS[0]] == payload(KEYS[0])
    stats = client.store.stats()
    assert stats["load_blocks_unauthenticated"] == 1 and stats["load_blocks_disk"] == 1
    assert stats["quarantined"] == 1 and not path.exists()
    assert KEY_A.hex() not in caplog.text and KEY_X.hex() not in caplog.text
    assert client.run(3, [forged], load=True).failures[0].step is Step.OPEN  # a plain miss now


def test_a_forged_block_read_ahead_by_a_preload_is_not_delivered(tmp_path, engine):
    client = engine(key_file(tmp_path, "keys", {"k1": KEY_A}))
    path = plant(client, KEYS[0], None)
    client.store.preload_blocks("request", [KEYS[0]])
    client.jobs[1] = [KEYS[0]]
    client.store.load_blocks(1, [BlockRef(KEYS[0], GEOMETRY)], owner="request")
    with client.done:
        assert client.done.wait_for(lambda: 1 in client.ends, timeout=20)
    assert client.ends[1].failures[0].step is Step.AUTH and KEYS[0] not in client.loaded
    stats = client.store.reactor.stats
    assert stats["preloads_started"] == 1 and stats["disk_reads"] >= 1 and not path.exists(), stats


def test_key_rotation_reads_old_blocks_while_listed_and_refuses_them_after(tmp_path, engine):
    old = key_file(tmp_path, "old", {"2026-06": KEY_A})
    first = engine(old)
    assert not first.run(1, KEYS[:2], load=False).failures
    rotated = key_file(tmp_path, "rotated", {"2026-12": KEY_B, "2026-06": KEY_A})
    second = engine(rotated)
    assert not second.run(2, KEYS[:2], load=True).failures  # old-key blocks still read
    assert not second.run(3, KEYS[2:], load=False).failures
    assert read_header(block_path(second, KEYS[2])).key_id == b"2026-12"  # new blocks: the new write key
    retired = key_file(tmp_path, "retired", {"2026-12": KEY_B})
    third = engine(retired)
    end = third.run(4, KEYS, load=True)
    assert {i: f.step for i, f in end.failures.items()} == {0: Step.AUTH, 1: Step.AUTH}  # old key gone
    assert third.loaded[KEYS[2]] == payload(KEYS[2])
    assert third.store.stats()["load_blocks_unauthenticated"] == 2


def test_without_a_key_unsigned_and_signed_blocks_load_with_a_key_only_signed(tmp_path, engine):
    keys = key_file(tmp_path, "keys", {"k1": KEY_A})
    keyless = engine(None)
    plant(keyless, KEYS[0], None)  # a v1 file
    plant(keyless, KEYS[1], load_key_ring(keys))  # a v2 file: its xxh3 is checked, its MAC ignored
    assert not keyless.run(1, KEYS[:2], load=True).failures
    keyed = engine(keys)
    end = keyed.run(2, KEYS[:2], load=True)
    assert {i: f.step for i, f in end.failures.items()} == {0: Step.AUTH}


def test_an_engine_refuses_to_start_with_a_readable_key_file(tmp_path, engine):
    keys = key_file(tmp_path, "keys", {"k1": KEY_A})
    os.chmod(keys, 0o644)
    with pytest.raises(KeyFileError, match="lets group or others read it"):
        engine(keys)


# -- pykv fsck --key-file --------------------------------------------------------------------------

def test_fsck_with_a_key_file_counts_each_class_and_repair_moves_only_bad_macs(tmp_path):
    path = key_file(tmp_path, "keys", {"k1": KEY_A})
    keys = load_key_ring(path)
    tree = make_tree(tmp_path)
    add_block(tree, key(0), keys=keys)
    add_block(tree, key(1), keys=keys)
    add_block(tree, key(2))
    add_block(tree, key(3), keys=ring(tmp_path, "other", {"x": KEY_X}))
    bad = add_block(tree, key(4), keys=keys)
    forge_bad_mac(bad)

    result = CliRunner().invoke(app, ["fsck", str(tree.root), "--key-file", str(path), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["auth"] == {"signed": 2, "unsigned": 1, "foreign-key": 1, "bad-mac": 1}
    assert [(f["path"], f["problem"]) for f in report["findings"]] == [(os.path.relpath(bad, tree.root), "bad-mac")]

    plain = CliRunner().invoke(app, ["fsck", str(tree.root), "--json"])  # without the key: all sound
    assert plain.exit_code == 0 and "auth" not in json.loads(plain.output)

    repaired = CliRunner().invoke(app, ["fsck", str(tree.root), "--key-file", str(path), "--repair"])
    assert repaired.exit_code == 0, repaired.output
    assert "authenticated: 2 signed, 1 unsigned, 1 foreign-key, 1 bad-mac" in repaired.output
    assert not bad.exists() and tree.block_path(TREE_NS.id, key(2)).exists()
    assert KEY_A.hex() not in repaired.output


def test_fsck_refuses_a_key_file_others_may_read_in_one_line(tmp_path):
    path = key_file(tmp_path, "keys", {"k1": KEY_A})
    os.chmod(path, 0o644)
    tree = make_tree(tmp_path)
    result = CliRunner().invoke(app, ["fsck", str(tree.root), "--key-file", str(path)])
    assert result.exit_code != 0
    assert f"--key-file {path}: mode 0644 lets group or others read it" in result.output
    assert len(result.output.strip().splitlines()) == 1 and KEY_A.hex() not in result.output
