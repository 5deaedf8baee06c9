"""Payload checksums (``verify="full"``) beside the reads, on a small thread pool.

xxh3-128 over a ~28 MiB block takes milliseconds; on the reactor thread it would stall every
other read (at 20+ GB/s one thread cannot keep up). xxhash releases the GIL while it hashes a
large buffer, so a few threads check blocks in parallel with the reactor's I/O. The reactor
hands over a block whose read is complete (its slot stays held) and gets the outcome back
through ``done`` (called on the verifier thread; the reactor posts it to its own thread).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from pykv.errors import FormatError
from pykv.failures import BlockFailure, Step
from pykv.format import BlockHeader, verify_payload

log = logging.getLogger(__name__)

THREAD_PREFIX = "pykv-verify"


class PayloadVerifier:
    """Checks payloads against their header's checksum on ``threads`` threads (started on demand)."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"verify_threads must be >= 1, got {threads}")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=THREAD_PREFIX)

    def submit(self, header: BlockHeader, payload: memoryview, path: object,
               done: Callable[[BlockFailure | None], None]) -> None:
        """Check ``payload`` (it must stay valid until ``done``); ``done(None)`` when it matches, else
        ``done(failure)``: ``Step.CHECK`` for a mismatch (a corrupt file)."""
        self._pool.submit(_check, header, payload, path, done)

    def close(self) -> None:
        """Wait for the checks under way and stop the threads."""
        self._pool.shutdown(wait=True)


def _check(header: BlockHeader, payload: memoryview, path: object,
           done: Callable[[BlockFailure | None], None]) -> None:
    failure = None
    try:
        verify_payload(header, payload, path=path)
    except FormatError as exc:
        failure = BlockFailure(Step.CHECK, detail=exc.reason)
    except Exception as exc:  # a bug, not a corrupt file: fail the load (recompute), never hang it
        log.exception("%s: payload verification raised", path)
        failure = BlockFailure(Step.READ, detail=f"payload verification raised {type(exc).__name__}")
    done(failure)
