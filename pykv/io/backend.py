"""The I/O backend contract: asynchronous file operations addressed by raw pointers.

A backend is owned by one thread (the reactor). ``submit`` queues operations,
``wait`` returns completions. Only ``wake`` may be called from other threads: it
makes a blocked ``wait`` return (possibly with no completions).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Sequence


class OpKind(enum.Enum):
    """The file operations a backend performs."""

    OPEN = "open"
    READ = "read"
    WRITE = "write"
    FSYNC = "fsync"
    CLOSE = "close"


@dataclass(slots=True)
class IoRequest:
    """One operation. ``token`` comes back unchanged in the completion.

    OPEN uses ``path``, ``flags``, ``mode`` and ``resolve`` (openat2 RESOLVE_* flags, see
    ``pykv.io.openat2``; 0 = plain openat); READ/WRITE use ``fd``, ``address``
    (a raw pointer into memory that outlives the operation), ``length`` and
    ``offset``; FSYNC and CLOSE use ``fd``.
    """

    op: OpKind
    token: object
    fd: int = -1
    path: bytes = b""
    flags: int = 0
    mode: int = 0
    resolve: int = 0
    address: int = 0
    length: int = 0
    offset: int = 0


@dataclass(slots=True, frozen=True)
class IoCompletion:
    """Result of one request: ``result`` >= 0 is bytes moved (or the new fd for OPEN);
    a negative value is ``-errno``. Backends resubmit EINTR/EAGAIN themselves;
    short reads/writes are reported as they are (the caller continues them)."""

    token: object
    result: int


class IoBackend(abc.ABC):
    """Asynchronous file I/O with a bounded number of operations in flight.

    Subclasses call ``__init__(depth)``, ``_admit`` before queuing a batch and
    count completions off ``_in_flight``.
    """

    name: str = "abstract"

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._depth = depth
        self._in_flight = 0
        self._closed = False

    def _admit(self, requests: Sequence[IoRequest]) -> None:
        """Refuse a batch on a closed backend or beyond ``depth``."""
        self._check_open()
        if self._in_flight + len(requests) > self._depth:
            raise ValueError(f"{self._in_flight} in flight + {len(requests)} new exceeds depth {self._depth}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.name} backend is closed")

    @abc.abstractmethod
    def submit(self, requests: Sequence[IoRequest]) -> None:
        """Start ``requests``. The caller never has more than ``depth`` in flight."""

    @abc.abstractmethod
    def wait(self, min_completions: int = 1, timeout: float | None = None) -> list[IoCompletion]:
        """Return completed requests: block until at least ``min_completions`` are done,
        ``timeout`` seconds pass, or ``wake`` is called. May return an empty list."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Thread-safe: make a pending or the next ``wait`` return promptly."""

    @property
    def depth(self) -> int:
        """Maximum operations in flight."""
        return self._depth

    @property
    def in_flight(self) -> int:
        """Operations submitted and not yet returned by ``wait``."""
        return self._in_flight

    def close(self) -> None:
        """Wait for in-flight operations, then release the backend's resources (idempotent)."""
        if self._closed:
            return
        try:
            while self._in_flight:
                self.wait(self._in_flight)
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        """Free the backend's resources (threads, ring, file descriptors); called once by ``close``."""

    def __enter__(self) -> "IoBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
