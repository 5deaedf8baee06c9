"""The medium seam is real: the reactor stores and loads through a dict-backed medium and I/O
backend, with nothing POSIX of its own (no file is opened, created or unlinked on disk)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from pathlib import Path
from typing import Sequence

import pytest

from pykv.failures import BlockFailure, Step
from pykv.format import HEADER_SIZE, Geometry
from pykv.io.backend import IoBackend, IoCompletion, IoRequest, OpKind
from pykv.media import Medium, OpenSpec, WriteTarget
from pykv.namespace import Namespace
from pykv.reactor import FillRequest, LoadBlock, Reactor, ReactorConfig, ReadyBlock, StoreBlock
from pykv.staging import StagingPool, slot_bytes_for

GEOMETRY = Geometry(tokens=64, segments=2, segment_bytes=5000)
NS = Namespace("tiny", "bf16", "test", 64)


class MemoryFiles:
    """Named byte strings and the handles open on them (shared by the medium and the backend)."""

    def __init__(self) -> None:
        self.files: dict[str, bytearray] = {}
        self.handles: dict[int, str] = {}
        self.next_fd = 1000


class MemoryBackend(IoBackend):
    """OPEN/READ/WRITE/FSYNC/CLOSE on ``MemoryFiles``, completed at once."""

    name = "memory"

    def __init__(self, store: MemoryFiles, depth: int = 256) -> None:
        super().__init__(depth)
        self.store = store
        self._done: list[IoCompletion] = []
        self._wake = threading.Event()

    def submit(self, requests: Sequence[IoRequest]) -> None:
        self._admit(requests)
        self._in_flight += len(requests)
        self._done += [IoCompletion(r.token, self._execute(r)) for r in requests]

    def _execute(self, r: IoRequest) -> int:
        files, name = self.store.files, os.fsdecode(r.path)
        if r.op is OpKind.OPEN:
            if r.flags & os.O_CREAT:
                if name in files:
                    return -errno.EEXIST
                files[name] = bytearray()
            elif name not in files:
                return -errno.ENOENT
            self.store.next_fd += 1
            self.store.handles[self.store.next_fd] = name
            return self.store.next_fd
        data = files[self.store.handles[r.fd]] if r.fd in self.store.handles else None
        if r.op is OpKind.READ:
            chunk = bytes(data[r.offset:r.offset + r.length])
            ctypes.memmove(r.address, chunk, len(chunk))
            return len(chunk)
        if r.op is OpKind.WRITE:
            data[r.offset:r.offset + r.length] = ctypes.string_at(r.address, r.length)
            return r.length
        if r.op is OpKind.CLOSE:
            del self.store.handles[r.fd]
        return 0

    def wait(self, min_completions: int = 1, timeout: float | None = None) -> list[IoCompletion]:
        if not self._done:
            self._wake.wait(timeout)
            self._wake.clear()
        done, self._done = self._done, []
        self._in_flight -= len(done)
        return done

    def wake(self) -> None:
        self._wake.set()


class DictMedium(Medium):
    """Blocks as entries of ``MemoryFiles``: ``mem/<namespace>/<key hex>``."""

    name = "dict"
    sync_before_publish = True

    def __init__(self, store: MemoryFiles) -> None:
        self.store = store
        self.quarantined: dict[str, bytes] = {}

    def locate(self, namespace_id: str, key: bytes) -> Path:
        return Path("mem", namespace_id, key.hex())

    def contains(self, namespace_id: str, key: bytes) -> bool:
        return str(self.locate(namespace_id, key)) in self.store.files

    def touch(self, location: Path) -> bool:
        return str(location) in self.store.files

    def open_for_read(self, location: Path) -> OpenSpec:
        return OpenSpec(os.fsencode(location), os.O_RDONLY)

    def check_opened(self, fd: int) -> int:
        return len(self.store.files[self.store.handles[fd]])

    def prepare_write(self, location: Path) -> WriteTarget:
        temp = location.with_name(location.name + ".tmp")
        return WriteTarget(temp, OpenSpec(os.fsencode(temp), os.O_WRONLY | os.O_CREAT | os.O_EXCL))

    def publish(self, temp: Path, location: Path) -> bool:
        data = self.store.files.pop(str(temp))
        return self.store.files.setdefault(str(location), data) is data

    def abandon(self, temp: Path) -> None:
        self.store.files.pop(str(temp), None)

    def quarantine(self, location: Path, run: str) -> Path:
        self.quarantined[f"{run}/{location}"] = bytes(self.store.files.pop(str(location)))
        return Path(run, location)


class Client:
    """Fills store slots with a pattern per block index; copies delivered payloads out."""

    def __init__(self) -> None:
        self.reactor: Reactor | None = None
        self.payloads: dict[int, bytes] = {}

    def fill(self, requests: list[FillRequest]) -> None:
        for r in requests:
            self.reactor.pool.payload_view(r.slot, r.length)[:] = pattern(r.index)
            self.reactor.filled(r.transfer, True)

    def deliver(self, blocks: list[ReadyBlock]) -> None:
        for b in blocks:
            self.payloads[b.index] = bytes(self.reactor.pool.payload_view(b.slot, b.header.payload_length))
            self.reactor.consumed(b.transfer)


def pattern(index: int) -> bytes:
    return bytes((index * 11 + i) % 253 for i in range(GEOMETRY.payload_length))


@pytest.fixture
def memory_reactor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the medium's locations are relative: anything on disk would land here
    store = MemoryFiles()
    medium, client = DictMedium(store), Client()
    pool = StagingPool(slot_bytes_for(GEOMETRY.payload_length), 3)
    reactor = client.reactor = Reactor(MemoryBackend(store), pool, medium, config=ReactorConfig(io_depth=2),
                                       sink=client, source=client)
    yield reactor, medium, store, client
    reactor.close()
    pool.close()
    assert list(tmp_path.iterdir()) == []  # nothing POSIX happened


def keys(count: int) -> list[bytes]:
    return [bytes([i]) * 20 for i in range(count)]


def reactor_log(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pykv.reactor"]


def test_a_store_and_a_load_run_through_a_dict_backed_medium(memory_reactor, caplog):
    caplog.set_level(logging.DEBUG, logger="pykv.reactor")
    reactor, medium, store, client = memory_reactor
    stores = [StoreBlock(medium.locate(NS.id, k), NS.fingerprint, k, GEOMETRY) for k in keys(4)]
    reactor.write("s", stores)
    stored = reactor.wait_for("s", timeout=30)
    assert stored.ok and stored.published == 4
    assert sorted(store.files) == sorted(str(b.path) for b in stores)  # published, no temporary left
    assert all(medium.contains(NS.id, k) for k in keys(4))
    assert not store.handles  # every handle closed through the backend

    loads = [LoadBlock(b.path, b.namespace, b.key, GEOMETRY) for b in stores]
    loads.append(LoadBlock(medium.locate(NS.id, b"\x09" * 20), NS.fingerprint, b"\x09" * 20, GEOMETRY))
    reactor.read("l", loads)
    loaded = reactor.wait_for("l", timeout=30)
    assert client.payloads == {i: pattern(i) for i in range(4)}
    assert loaded.failed == {4: BlockFailure(Step.OPEN, errno.ENOENT, os.strerror(errno.ENOENT))}
    assert reactor_log(caplog) == [(logging.DEBUG, f"{loads[4].path}: open: {os.strerror(errno.ENOENT)}")]  # a miss


def test_the_reactor_checks_what_the_medium_returns_and_never_replaces_a_block(memory_reactor, caplog):
    caplog.set_level(logging.DEBUG, logger="pykv.reactor")
    reactor, medium, store, client = memory_reactor
    stores = [StoreBlock(medium.locate(NS.id, k), NS.fingerprint, k, GEOMETRY) for k in keys(2)]
    reactor.write("s", stores)
    assert reactor.wait_for("s", timeout=30).ok
    store.files[str(stores[1].path)][HEADER_SIZE + 10] ^= 1  # a payload bit flip
    first = bytes(store.files[str(stores[0].path)])

    reactor.write("again", stores[:1])  # another writer's copy of block 0: the first one stays
    again = reactor.wait_for("again", timeout=30)
    assert again.ok and again.published == 0 and bytes(store.files[str(stores[0].path)]) == first

    reactor.read("l", [LoadBlock(b.path, b.namespace, b.key, GEOMETRY) for b in stores])
    loaded = reactor.wait_for("l", timeout=30)
    assert list(loaded.failed) == [1] and loaded.failed[1].corrupt and "checksum" in str(loaded.failed[1])
    assert client.payloads == {0: pattern(0)}
    assert [level for level, message in reactor_log(caplog)] == [logging.WARNING]  # corruption is no routine miss
