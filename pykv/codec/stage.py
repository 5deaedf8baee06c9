"""``CodecStage``: a worker's codec step between the engine's copies and the staging slots.

A store's payload is copied raw into its slot by the engine's copier, then encoded here
(``encode``): when the stored bytes are smaller they replace the payload at the start of the
slot, otherwise the block is stored raw (codec ``none``; a codec refusing a payload also
stores it raw). The engine runs ``planes-zstd`` here (``fp8`` runs on the KV's device:
``pykv.connector.device_codec``); for ``fp8-zstd`` the device's fp8 bytes are coded here by
the zstd layer (``recode``). A load's stored bytes are decoded here
(``decode``) into a scratch buffer, which the copier copies to the engine and then hands back
(``release``): a slot's bytes are never changed by a load, so a DRAM-tier slot serves the
next hit as it is.

Bounded memory: one pool of ``threads + SPARE_BUFFERS`` scratch buffers of one slot each
(page-locked with ``register`` on CUDA), allocated once; codec work waits for a free buffer.
It runs on ``threads`` threads; zstd and numpy release the GIL. No torch and no vLLM here.
"""

from __future__ import annotations

import logging
import threading
import queue
import time
from typing import Callable

from pykv.codec.base import Codec, CodecError
from pykv.daemon_threads import start_daemon_threads
from pykv.failures import BlockFailure, Step
from pykv.staging import StagingPool

log = logging.getLogger(__name__)

THREAD_PREFIX = "pykv-codec"
SPARE_BUFFERS = 2
"""Scratch buffers beyond one per thread: decodes go on while decoded blocks are being copied."""

Stored = int | None
"""What ``encode`` made of a payload: the stored length now at the start of the slot, or None (raw)."""
Decoded = Callable[[int | None, BlockFailure | None], None]
"""``done(buffer, failure)`` of a decode: the scratch buffer holding the payload, or why there is none."""


class CodecStage:
    """Encodes store payloads in place and decodes loads into scratch buffers; thread-safe."""

    def __init__(self, codec: Codec, scratch_bytes: int, *, threads: int,
                 register: Callable[[int, int], None] | None = None,
                 unregister: Callable[[int], None] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"codec threads must be >= 1, got {threads}")
        self.codec = codec
        self.scratch = StagingPool(scratch_bytes, threads + SPARE_BUFFERS, register=register, unregister=unregister)
        self._free = list(range(self.scratch.num_slots))
        self._freed = threading.Condition()
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = start_daemon_threads(self._serve, threads, THREAD_PREFIX)  # daemons: never hold an exit

    @property
    def params(self) -> str:
        """The codec's identity, as block headers record it."""
        return self.codec.params

    # -- stores ------------------------------------------------------------------------------------
    def encode(self, payload: memoryview, done: Callable[[Stored], None]) -> None:
        """Encode the raw ``payload`` (a slot's payload bytes, writable) on a codec thread;
        ``done(stored)`` there once the slot holds what is to be written."""
        self._submit(lambda: self._encode(payload, done))

    def _encode(self, payload: memoryview, done: Callable[[Stored], None]) -> None:
        stored: Stored = None
        buffer = self._take()
        if buffer is None:  # closing: stored raw
            done(None)
            return
        try:
            out = self.scratch.view(buffer)
            if self.codec.encoded_bound(len(payload)) <= len(out):
                length = self.codec.encode(payload, out)
                if length < len(payload):
                    payload[:length] = out[:length]
                    stored = length
        except CodecError as exc:
            log.debug("pykv: %s; the block is stored raw", exc)
        except Exception:  # a bug: the block is stored raw, never lost
            log.exception("pykv: encoding a block raised; it is stored raw")
        finally:
            self.release(buffer)
        done(stored)

    def recode(self, payload: memoryview, inner: int, done: Callable[[Stored], None]) -> None:
        """Encode the first ``inner`` bytes of ``payload`` (a slot's payload bytes, writable; a
        device step's stored bytes) on a codec thread, always: ``done(stored)`` there once the
        slot starts with the ``stored`` bytes, or ``done(None)`` if they could not be (the block
        is not stored: its slot holds neither raw KV nor this codec's bytes)."""
        self._submit(lambda: self._recode(payload, inner, done))

    def _recode(self, payload: memoryview, inner: int, done: Callable[[Stored], None]) -> None:
        stored: Stored = None
        buffer = self._take()
        if buffer is None:  # closing
            done(None)
            return
        try:
            out = self.scratch.view(buffer)
            if 0 <= inner <= len(payload) and self.codec.encoded_bound(inner) <= min(len(out), len(payload)):
                length = self.codec.encode(payload[:inner], out)
                payload[:length] = out[:length]
                stored = length
            else:
                log.warning("pykv: %d stored bytes do not fit a slot once coded by %s; the block is not stored",
                            inner, self.codec.name)
        except CodecError as exc:
            log.warning("pykv: %s; the block is not stored", exc)
        except Exception:  # a bug: the block is not stored, nothing is lost
            log.exception("pykv: coding a block's stored bytes raised; it is not stored")
        finally:
            self.release(buffer)
        done(stored)

    # -- loads -------------------------------------------------------------------------------------
    def decode(self, stored: memoryview, raw_length: int, params: str, done: Decoded) -> None:
        """Decode ``stored`` (a slot's stored bytes) to ``raw_length`` bytes on a codec thread;
        ``done(buffer, None)`` there with the scratch buffer holding them (``release`` it after the
        copy), or ``done(None, failure)``: ``Step.CHECK`` for bytes this engine refuses (another
        codec's, or undecodable: the file is corrupt), ``Step.COPY`` when the stage could not try."""
        self._submit(lambda: self._decode(stored, raw_length, params, done))

    def _decode(self, stored: memoryview, raw_length: int, params: str, done: Decoded) -> None:
        if params != self.codec.params:
            done(None, BlockFailure(Step.CHECK, detail=f"stored by codec {params[:80]!r}, not this engine's"))
            return
        if not 0 <= raw_length <= self.scratch.slot_bytes:
            done(None, BlockFailure(Step.CHECK, detail=f"decodes to {raw_length} bytes, more than a slot"))
            return
        buffer = self._take()
        if buffer is None:
            done(None, BlockFailure(Step.COPY, detail="the codec stage is closing"))
            return
        try:
            self.codec.decode(stored, self.scratch.view(buffer)[:raw_length])
        except CodecError as exc:
            self.release(buffer)
            done(None, BlockFailure(Step.CHECK, detail=str(exc)))
            return
        except Exception:  # a bug: this block is recomputed, nothing hangs
            log.exception("pykv: decoding a block raised; it is recomputed")
            self.release(buffer)
            done(None, BlockFailure(Step.COPY, detail="decoding raised"))
            return
        done(buffer, None)

    def view(self, buffer: int) -> memoryview:
        """The bytes of scratch ``buffer``."""
        return self.scratch.view(buffer)

    def release(self, buffer: int) -> None:
        """Scratch ``buffer`` is free again (its decoded bytes were copied out)."""
        with self._freed:
            self._free.append(buffer)
            self._freed.notify()

    def _take(self) -> int | None:
        """A free scratch buffer, waiting for one; None once the stage closes."""
        with self._freed:
            while not self._free and not self._closed:
                self._freed.wait()
            return self._free.pop() if self._free and not self._closed else None

    def _submit(self, work: Callable[[], None]) -> None:
        if self._threads:
            self._work.put(work)
        else:  # the process would start no thread: the caller's thread does it
            work()

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            try:
                work()
            except Exception:  # noqa: BLE001 - the work answers its caller itself; a thread outlives a bug
                log.exception("pykv: codec work raised")

    def close(self, timeout: float = 30.0) -> bool:
        """Finish the codec work under way (work still waiting for a buffer gives up) and free the
        scratch memory; after the copier stopped, so no decoded buffer is still being copied. False
        (the memory kept) when a thread did not finish within ``timeout``."""
        with self._freed:
            if self._closed:
                return True
            self._closed = True
            self._freed.notify_all()
        for _ in self._threads:
            self._work.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            log.warning("pykv: codec work did not finish within %.0f s; its scratch memory stays allocated", timeout)
            return False
        self.scratch.close()
        return True
