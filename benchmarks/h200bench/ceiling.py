"""The most a disk hit's byte movements can reach on this host, without pykv (``mbw`` engines
``ceiling-*``).

A load moves each byte up to three times here: the loop device copies it out of tmpfs into a
page-locked slot (the O_DIRECT read), xxh3 reads it (``verify=full``), the GPU's DMA reads it (the
H2D copy). A ceiling pass reads every device's file through one io_uring (as
``multibw.one_ring``: ``depth`` reads in flight per device, twice as many slots per device) and,
before a slot is read into again, hashes it on ``HASH_THREADS`` threads and/or copies it whole to
GPU memory in one copy (the cheapest copy there is; vLLM's block order costs pykv more). Modes,
by engine name: ``ceiling-h2d``, ``ceiling-hash``, ``ceiling-hash-h2d``. Set beside the plain
reads of the same call, they say how much of the O_DIRECT aggregate a load can keep on this medium.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from h200bench.util import close_pass, read_pass_result

MODES = {"ceiling-h2d": (False, True), "ceiling-hash": (True, False), "ceiling-hash-h2d": (True, True)}
"""engine name -> (hash each slot, copy each slot to the GPU)."""
HASH_THREADS = 8  # the engines' verify_threads on this host


class SlotSink:
    """What happens to a slot after its read: hashed on a pool, copied to the GPU on one stream by
    one thread, then handed back (``freed``) and the reader woken."""

    def __init__(self, pool, *, hash_slots: bool, h2d: bool, wake) -> None:
        self.freed: queue.SimpleQueue = queue.SimpleQueue()
        self._pool, self._wake = pool, wake
        self._hashes = ThreadPoolExecutor(HASH_THREADS) if hash_slots else None
        self._copies: queue.SimpleQueue | None = None
        self.errors: list[BaseException] = []
        if h2d:
            import torch

            self._torch = torch
            self._sources = [torch.frombuffer(pool.view(s), dtype=torch.uint8) for s in range(pool.num_slots)]
            self._target = torch.empty((pool.num_slots, pool.slot_bytes), dtype=torch.uint8, device="cuda")
            self._stream = torch.cuda.Stream()
            self._copies = queue.SimpleQueue()
            self._copier = threading.Thread(target=self._copy_loop, daemon=True)
            self._copier.start()

    def take(self, token) -> None:
        """A slot's read ended (``token`` = (device, slot))."""
        if self._hashes is not None:
            self._hashes.submit(self._hash, token)
        else:
            self._hashed(token)

    def _hash(self, token) -> None:
        import xxhash

        try:
            xxhash.xxh3_64_intdigest(self._pool.view(token[1]))
        except BaseException as exc:  # noqa: BLE001 - reported by the pass
            self.errors.append(exc)
        self._hashed(token)

    def _hashed(self, token) -> None:
        if self._copies is not None:
            self._copies.put(token)
        else:
            self._free(token)

    def _free(self, token) -> None:
        self.freed.put(token)
        self._wake()

    def _copy_loop(self) -> None:
        torch, pending = self._torch, []
        while True:
            try:
                token = self._copies.get(timeout=0.0005 if pending else None)
            except queue.Empty:
                token = False
            if token is None:
                return
            if token is not False:
                try:
                    with torch.cuda.stream(self._stream):
                        self._target[token[1]].copy_(self._sources[token[1]], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self._stream)
                    pending.append((event, token))
                except BaseException as exc:  # noqa: BLE001 - reported by the pass
                    self.errors.append(exc)
                    self._free(token)
            while pending and pending[0][0].query():
                self._free(pending.pop(0)[1])

    def close(self) -> None:
        if self._copies is not None:
            self._copies.put(None)
            self._copier.join()
        if self._hashes is not None:
            self._hashes.shutdown()


def page_lock(address: int, length: int) -> None:
    """``cuda_host_register`` of ``pykv.connector.copier``, whose module needs vLLM (not on this run)."""
    import torch

    result = torch.cuda.cudart().cudaHostRegister(address, length, 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister of {length} bytes failed: {result}")


def page_unlock(address: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)


def ceiling_pass(paths: list[Path], engine: str, *, size: int, block: int, depth: int) -> dict:
    """Read ``size`` bytes of each path in ``block`` requests (``depth`` in flight per device, one ring),
    passing each read slot through the mode's hash and GPU copy before it is reused."""
    from pykv.io.backend import IoRequest, OpKind
    from pykv.io.probe import open_backend
    from pykv.staging import StagingPool

    hash_slots, h2d = MODES[engine]
    count, blocks, per_device = len(paths), size // block, 2 * depth
    register = unregister = None
    if h2d:  # page-locked, as the engine's slots
        register, unregister = page_lock, page_unlock
    pool = StagingPool(block, per_device * count, populate=True, register=register, unregister=unregister)
    backend, fds, sink = None, [], None
    try:
        backend = open_backend("io_uring", depth=per_device * count + 2)
        sink = SlotSink(pool, hash_slots=hash_slots, h2d=h2d, wake=backend.wake)
        fds = [os.open(p, os.O_DIRECT | os.O_CLOEXEC | os.O_RDONLY) for p in paths]
        free = [list(range(d * per_device, (d + 1) * per_device)) for d in range(count)]
        next_block, done, ends = [0] * count, [0] * count, [0.0] * count
        in_flight = [0] * count
        started = time.perf_counter()
        while min(done) < blocks:
            if sink.errors:
                raise sink.errors[0]
            while True:
                try:
                    d, slot = sink.freed.get_nowait()
                except queue.Empty:
                    break
                free[d].append(slot)
                done[d] += 1
                if done[d] == blocks:
                    ends[d] = time.perf_counter()
            batch = []
            for d in range(count):
                while free[d] and in_flight[d] < depth and next_block[d] < blocks:
                    slot = free[d].pop()
                    batch.append(IoRequest(OpKind.READ, (d, slot, next_block[d]), fd=fds[d],
                                           address=pool.address(slot), length=block, offset=next_block[d] * block))
                    next_block[d] += 1
                    in_flight[d] += 1
            if batch:
                backend.submit(batch)
            if min(done) >= blocks:
                break
            for completion in backend.wait(1):
                d, slot, index = completion.token
                if completion.result != block:
                    raise OSError(f"{paths[d]}: read of block {index} returned {completion.result}")
                in_flight[d] -= 1
                sink.take((d, slot))
    finally:
        if sink is not None:
            sink.close()
        close_pass(fds, backend, pool)
    return read_pass_result(size, count, started, ends)
