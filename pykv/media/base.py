"""The medium contract: what the reactor asks of the storage that holds block files.

The reactor schedules; a medium knows where a block lives and how to reach it. Every
I/O that moves bytes (open, read, write, fsync, close) still runs on the reactor's I/O
backend; the medium says *how* to open a block (``OpenSpec``: the path and flags the
backend's OPEN takes), checks what an open returned, and carries out the synchronous
steps around a store (directories, temporary name, publication, abandon), the
quarantine of a corrupt block, and the scheduler's lookup and access stamp. Those
synchronous steps block on a stalled mount, so the reactor makes them on the threads of the
block's device (``lane``; ``pykv.reactor.fileops``), never on its own thread.

A block is named by its *location*, a ``Path`` the medium hands out (``locate``); every
other call takes a location back. A medium over several roots or devices (a striped set)
maps each (namespace, key) to one of them in ``locate`` and routes the other calls by the
location's root. Failures are ``OSError``s with an errno; the reactor turns them into a
``BlockFailure`` of the step it was doing.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class OpenSpec:
    """How the I/O backend opens one file: ``IoRequest(OpKind.OPEN, path=..., flags=..., mode=..., resolve=...)``."""

    path: bytes
    flags: int
    mode: int = 0
    resolve: int = 0  # openat2 RESOLVE_* flags (pykv.io.openat2); 0: a plain open


@dataclass(frozen=True)
class WriteTarget:
    """A store's temporary file: its location and how the backend opens it (exclusive create)."""

    temp: Path
    open: OpenSpec


class Medium(abc.ABC):
    """Where block files live. Called from the reactor thread and its devices' threads (the blocking
    calls: ``check_opened``, ``prepare_write``, ``publish``, ``abandon``, ``quarantine``), so a
    call may run beside another."""

    name: str = "abstract"

    @property
    def lanes(self) -> int:
        """Independent devices under this medium; each gets its own in-flight depth (``lane``)."""
        return 1

    def lane(self, location: Path) -> int:
        """The device (``0..lanes-1``) that holds ``location``."""
        return 0

    def first_lane(self, namespace_id: str, key: bytes) -> int:
        """The device ``locate`` asks first for the block (no I/O): where a blocking call that starts
        from the key, not a location (a quarantine's ``locate``), is made."""
        return 0

    @property
    def opens_direct(self) -> bool:
        """Every device's block files are opened with ``O_DIRECT`` (False: buffered I/O somewhere)."""
        return False

    @property
    @abc.abstractmethod
    def sync_before_publish(self) -> bool:
        """Stores fsync the written file before ``publish`` (the durability option)."""

    @abc.abstractmethod
    def locate(self, namespace_id: str, key: bytes) -> Path:
        """The location of block ``key`` of namespace ``namespace_id``: where it is, or where a lookup
        looks first when it is nowhere (nothing is created)."""

    def place(self, namespace_id: str, keys: Sequence[bytes]) -> list[Path]:
        """Where one store writes each of ``keys`` (in order): a block already there keeps its location."""
        return [self.locate(namespace_id, key) for key in keys]

    def locate_on(self, lane: int, namespace_id: str, key: bytes) -> Path:
        """The block's location on device ``lane``, one of its candidates (no I/O: a caller that found
        the device holding it, ``pykv.holders``). One device: ``locate``, which makes no I/O there."""
        return self.locate(namespace_id, key)

    def place_held(self, namespace_id: str, keys: Sequence[bytes], held: Sequence[int | None]) -> list[Path]:
        """``place`` with each block's holder found already (``held[i]``: the device holding ``keys[i]``,
        None: none of its candidates does): the placement alone, no I/O."""
        return [self.locate(namespace_id, key) for key in keys]

    @abc.abstractmethod
    def contains(self, namespace_id: str, key: bytes) -> bool:
        """Whether the block is published (the scheduler's lookup: cheap, no read; a link is no block)."""

    @abc.abstractmethod
    def touch(self, location: Path) -> bool:
        """Stamp a block as used now (eviction by ``pykv gc`` goes by it); False when it is gone."""

    @abc.abstractmethod
    def open_for_read(self, location: Path) -> OpenSpec:
        """How to open a block for reading: never through a link, never blocking on a planted FIFO."""

    @abc.abstractmethod
    def check_opened(self, fd: int) -> int:
        """The opened block's size; ``OSError`` when it is not a regular file (a FIFO, device or
        directory planted at its name) or cannot be examined. The fd stays open either way."""

    @abc.abstractmethod
    def prepare_write(self, location: Path) -> WriteTarget:
        """Create what a store of ``location`` needs (directories) and name its temporary file;
        ``OSError`` when the medium refuses (no space, read-only, a link planted on the way)."""

    @abc.abstractmethod
    def publish(self, temp: Path, location: Path) -> bool:
        """Make the written ``temp`` the block at ``location`` without ever replacing what is there;
        ``temp`` is gone afterwards. False when another writer published it first."""

    @abc.abstractmethod
    def abandon(self, temp: Path) -> None:
        """Remove the temporary file of a failed store (best effort, never raises)."""

    @abc.abstractmethod
    def quarantine(self, location: Path, run: str) -> Path:
        """Move a corrupt block out of the cache, keeping it for inspection; return where it went.
        ``FileNotFoundError`` when it is already gone; never deletes."""
