"""Payload hashing beside the reads and writes, on a small thread pool: the xxh3 checksum of
``verify="full"``, with a key ring (``auth_key_file``) the keyed BLAKE3 MAC of every load, and
the sealing of every store (its checksum, and with a key ring its MAC).

Hashing a ~28 MiB block takes milliseconds; on the reactor thread it would stall every other
read (at 20+ GB/s one thread cannot keep up). xxhash and blake3 release the GIL while they
hash a large buffer, so a few threads hash blocks in parallel with the reactor's I/O. The
reactor hands over a block whose read is complete or whose fill is done (its slot stays held)
and gets the outcome back through ``done`` (called on the hashing thread; the reactor posts it
to its own thread).

With a ring, a load's payload is checked by its MAC alone: the MAC covers the header and the
payload and detects every change the xxh3-128 would, so the checksum is not computed too.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from pykv.auth import AuthError, KeyRing, authenticate, sign
from pykv.errors import FormatError
from pykv.failures import BlockFailure, Step
from pykv.format import BlockHeader, build_header, encode_header, verify_payload
from pykv.format_codec import NONE
from pykv.reactor.types import StoreBlock

log = logging.getLogger(__name__)

THREAD_PREFIX = "pykv-verify"


class PayloadVerifier:
    """Checks payloads against their header (checksum, or MAC with ``keys``) and seals signed stores,
    on ``threads`` threads (started on demand)."""

    def __init__(self, threads: int, keys: KeyRing | None = None) -> None:
        if threads < 1:
            raise ValueError(f"verify_threads must be >= 1, got {threads}")
        self.keys = keys
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=THREAD_PREFIX)

    def submit(self, header: BlockHeader, head: memoryview, payload: memoryview, path: object,
               done: Callable[[BlockFailure | None], None]) -> None:
        """Check ``payload`` (``head``: the encoded header; both must stay valid until ``done``);
        ``done(None)`` when it matches, else ``done(failure)``: ``Step.CHECK`` for a checksum
        mismatch (a corrupt file), ``Step.AUTH`` for a block the key ring refuses."""
        self._pool.submit(_check, self.keys, header, head, payload, path, done)

    def seal(self, block: StoreBlock, head: memoryview, payload: memoryview,
             done: Callable[[BlockHeader | None], None], *, codec: str = NONE) -> None:
        """Build and encode the header of a filled store ``block`` into ``head`` (signed with a key
        ring; ``payload``: the stored bytes, encoded by ``codec``); ``done(header)``, or ``done(None)``
        if that raised (a bug: the store fails, nothing hangs)."""
        self._pool.submit(_seal, self.keys, block, head, payload, codec, done)

    def close(self) -> None:
        """Wait for the checks under way and stop the threads."""
        self._pool.shutdown(wait=True)


def seal_header(block: StoreBlock, head: memoryview, payload: memoryview, keys: KeyRing | None,
                codec: str = NONE) -> BlockHeader:
    """Put the header of a filled store block into ``head`` (signed when ``keys``; ``payload`` stored
    by ``codec``); return it."""
    header = build_header(block.namespace, block.key, block.geometry, payload,
                          key_id=keys.write_id if keys is not None else b"", codec=codec)
    encode_header(header, head)
    if keys is None:
        return header
    return dataclasses.replace(header, mac=sign(keys, head, payload))


def _check(keys: KeyRing | None, header: BlockHeader, head: memoryview, payload: memoryview, path: object,
           done: Callable[[BlockFailure | None], None]) -> None:
    failure = None
    try:
        if keys is None:
            verify_payload(header, payload, path=path)
        else:
            authenticate(keys, header, head, payload, path=path)
    except AuthError as exc:
        failure = BlockFailure(Step.AUTH, detail=exc.reason)
    except FormatError as exc:
        failure = BlockFailure(Step.CHECK, detail=exc.reason)
    except Exception as exc:  # a bug, not a corrupt file: fail the load (recompute), never hang it
        log.exception("%s: payload verification raised", path)
        failure = BlockFailure(Step.READ, detail=f"payload verification raised {type(exc).__name__}")
    done(failure)


def _seal(keys: KeyRing | None, block: StoreBlock, head: memoryview, payload: memoryview, codec: str,
          done: Callable[[BlockHeader | None], None]) -> None:
    header = None
    try:
        header = seal_header(block, head, payload, keys, codec)
    except Exception:  # a bug: fail the store, never hang it
        log.exception("%s: sealing the block raised", block.path)
    done(header)
