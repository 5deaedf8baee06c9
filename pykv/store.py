"""``BlockStore``: a worker's blocks from submission to their end, on one medium.

The one place that assembles the core for a process that moves blocks: the tree
and its medium (``pykv.media``), the staging pool with its DRAM-tier slots, the I/O
backend and the reactor (``build_reactor``). It keeps a pure ``JobLedger`` (``pykv.jobledger``) of
every job and carries out what the ledger decides:

- a load's DRAM-tier blocks are served from their slots without I/O (each slot's
  header checked, all blocks to the client as one copy batch), its other blocks go
  through the reactor; a job with both is split and ends when both parts have;
- a store ends for its client once its blocks are sealed in DRAM-tier slots (early
  release), or when its files are published;
- a corrupt file is quarantined; a store the medium refused pauses stores
  (``StorePause``) for ``store_retry_interval``, with one warning per pause.

The client (the vLLM worker, or any engine) implements ``StoreClient``: it copies
between its memory and the slots (``to_slots``/``from_slots``) and hears how each
job ended (``job_ended``, ``store_released``); those types live in ``pykv.store_types``
(re-exported here). All failures are typed
(``BlockFailure``). No vLLM and no torch here.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from typing import Callable, Hashable, Sequence

from pykv.auth import load_key_ring
from pykv.config import PykvConfig
from pykv.errors import FormatError
from pykv.failures import BlockFailure, Step, os_failure
from pykv.holders import BlockHolders
from pykv.io.probe import open_backend
from pykv.jobledger import JobEnd, JobLedger, Part
from pykv.policy import Kind
from pykv.deviceset import DeviceSet
from pykv.media.build import devices_take_direct, io_engine_for, open_store_medium
from pykv.reactor.fileops import Outcome
from pykv.reactor import FillRequest, JobResult, LoadBlock, Reactor, ReactorConfig, ReadyBlock, StoreBlock, \
    backend_depth, slot_header
from pykv.residency import StorePause
from pykv.stall import StallWatch
from pykv.staging import StagingPool
from pykv.store_types import BlockRef, CopyDone, EngineShape, SlotCopy, StoreClient
from pykv.tree import TreeOptions
from pykv.counters import WorkerCounter as C

__all__ = ["BlockRef", "BlockStore", "CopyDone", "EngineShape", "SlotCopy", "StoreClient", "build_reactor",
           "open_devices"]

log = logging.getLogger(__name__)


def open_devices(config: PykvConfig) -> DeviceSet:
    """The tree on each of ``config``'s devices (``root`` or ``roots``) with the configured modes."""
    return DeviceSet.create(config.root_paths, TreeOptions(config.file_mode, config.dir_mode, config.fsync),
                            field=config.root_key)


def build_reactor(config: PykvConfig, pool: StagingPool, devices: DeviceSet, *, client: object,
                  on_job_done: Callable[[JobResult], None] | None = None) -> Reactor:
    """The medium, the I/O backend and the reactor for ``config`` (with the key ring of
    ``auth_key_file``): the one place they are built (the store and ``pykv bench`` both call it). ``on_job_done=None``: results are kept for ``wait_for``."""
    medium = open_store_medium(devices, direct=devices_take_direct(devices))
    reactor_config = ReactorConfig(config.io_depth, config.open_ahead, config.verify,
                                   max_speculative=config.preload_max_bytes // pool.slot_bytes,
                                   read_segment=config.read_segment_bytes, verify_threads=config.hashing_threads())
    backend = open_backend(io_engine_for(config.io_engine, medium),
                           depth=backend_depth(reactor_config, pool.slot_bytes, medium.lanes), directory=devices[0].root)
    keys = load_key_ring(config.auth_key_file).with_hash_threads(config.mac_threads) if config.auth_key_file else None
    return Reactor(backend, pool, medium, config=reactor_config, sink=client, source=client,
                   on_job_done=on_job_done, keys=keys)


class BlockStore:
    """Jobs of blocks on one medium, with a DRAM tier; see the module docstring. Thread-safe."""

    def __init__(self, config: PykvConfig, engine: EngineShape, client: StoreClient, *,
                 register: Callable[[int, int], None] | None = None, unregister: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.engine, self.client, self._clock = config, engine, client, clock
        self.namespace = engine.namespace
        self.ledger = JobLedger(early_release=engine.early_release)
        self.counters: Counter[str] = self.ledger.counters
        self.pause = StorePause(config.store_retry_interval, extend=True)
        self.devices = open_devices(config)
        try:
            self.devices.ensure_namespace(self.namespace)
        except OSError as exc:
            self._pause_stores(os_failure(Step.MKDIR, exc))
        self.dram_base, self.dram_slots = engine.transient_slots, engine.dram_slots
        self.pool = StagingPool(engine.slot_bytes, engine.transient_slots + engine.dram_slots,
                                reserved=engine.dram_slots, register=register, unregister=unregister)
        self.counters[C.STAGING_BYTES] = self.pool.total_bytes
        self.counters[C.STAGING_HUGE_BYTES] = self.pool.huge_bytes() or 0
        self._lock = threading.Condition()
        self._stopped = False
        self.stalls = StallWatch(config.io_deadline)  # reactor parts, given up after io_deadline without progress
        self._stall_check_due = 0.0
        self.io_stopped = True  # after stop_io: the reactor stopped (False: I/O in flight never returned)
        self.reactor = build_reactor(config, self.pool, self.devices, client=self, on_job_done=self._reactor_job_done)
        self.medium = self.reactor.medium
        self.holders = BlockHolders(self.medium, self.devices, self.namespace.id, config.lookup_deadline, self.counters)

    # -- jobs ----------------------------------------------------------------------------------
    def load_blocks(self, job: object, blocks: Sequence[BlockRef], *, owner: Hashable | None = None,
                    urgent: bool = False) -> None:
        """Load ``blocks``: DRAM-tier blocks from their slots, the rest through the reactor (a block
        being preloaded for ``owner`` is served by its preload). ``urgent``: ahead of all other work."""
        slots = [self._pool_slot(b.dram_slot) for b in blocks]
        with self._lock:
            parts = self.ledger.open_load(job, [b.key for b in blocks], slots, [b.resident for b in blocks],
                                          self._clock())
        if urgent:
            self.counters[C.LOAD_JOBS_EXPEDITED] += 1
        for part in parts:  # a DRAM part's blocks need no lookup (``readable``): their slots hold them
            paths, failed = self.holders.readable([blocks[i].key for i in part.indices], find=not part.from_dram)
            loads = [LoadBlock(path, self.namespace.fingerprint, blocks[i].key, blocks[i].geometry, slot=slots[i],
                               target=blocks[i].target) for i, path in zip(part.indices, paths)]
            if part.from_dram:
                self._serve_from_dram(part, loads)
                continue
            with self._lock:
                self.ledger.unread(part.id, failed)  # blocks without a known holder: recomputed
                self.stalls.watch(part.id, Kind.LOAD, len(loads), self._clock())
            self.reactor.read(part.id, loads, owner=owner, urgent=urgent)

    def store_blocks(self, job: object, blocks: Sequence[BlockRef]) -> bool:
        """Store ``blocks``; False (nothing submitted, ``job_ended`` not called) while stores are paused."""
        if self.pause.active(self._clock()):
            self.counters[C.STORE_BLOCKS_PAUSED] += len(blocks)
            return False
        slots = [self._pool_slot(b.dram_slot) for b in blocks]
        paths, unstored = self.holders.writable([b.key for b in blocks])  # no device answered: unstored
        with self._lock:
            part = self.ledger.open_store(job, [b.key for b in blocks], slots, self._clock(), unstored)
            self.stalls.watch(part.id, Kind.STORE, len(part.indices), self._clock())
        self.reactor.write(part.id, [
            StoreBlock(path, self.namespace.fingerprint, blocks[i].key, blocks[i].geometry, slot=slots[i],
                       target=blocks[i].target, codec=self.engine.codec) for i, path in zip(part.indices, paths)])
        return True

    def preload_blocks(self, owner: Hashable, keys: Sequence[bytes]) -> None:
        """Read these blocks ahead for ``owner`` (a request still waiting); its load claims them."""
        self.counters[C.PRELOAD_BLOCKS_PLANNED] += len(keys)
        paths, _ = self.holders.readable(keys)  # up to the first block without a known holder
        self.reactor.read_ahead(owner, [LoadBlock(path, self.namespace.fingerprint, k) for k, path in zip(keys, paths)])

    def release_preloads(self, owner: Hashable) -> None:
        self.reactor.release_preloads(owner)

    def wait_engine_blocks(self, jobs: Sequence[object]) -> None:
        """Block until the engine may reuse these jobs' blocks: a load's once it ends, a store's once
        every block is copied into a host slot (its write may still run). A store's blocks that
        find no free slot are shed (``Step.SHED``, not stored): the engine never waits on the disk."""
        with self._lock:
            if not self.ledger.holds_engine_blocks(jobs):
                return
        self.reactor.shed_stores(jobs, self._shed)
        while True:
            with self._lock:
                if not self.ledger.holds_engine_blocks(jobs):
                    return
                self._lock.wait(min(1.0, self.stalls.deadline / 4))
            self.check_stalls()  # a stalled mount holds them at most io_deadline

    def _shed(self, blocks: list[tuple[object, int]]) -> None:
        """The reactor dropped these store blocks before they had a slot (reactor thread)."""
        if not blocks:
            return
        with self._lock:
            for part, index in blocks:
                self.ledger.filled(part, index, False, 0)
            self.counters[C.STORE_BLOCKS_SHED] += len(blocks)
            self._lock.notify_all()

    @property
    def open_jobs(self) -> int:
        with self._lock:
            return self.ledger.open_jobs

    def stats(self) -> dict[str, int]:
        """The store's counters and the reactor's (``delivered_*`` include the DRAM fast path's)."""
        stats = {**self.counters, **self.reactor.stats}
        for total, from_dram in ((C.DELIVERED_BLOCKS, C.DRAM_DELIVERED_BLOCKS), (C.DELIVERED_BYTES, C.DRAM_DELIVERED_BYTES)):
            stats[total] = stats.get(total, 0) + self.counters[from_dram]
        return stats

    def stop_io(self) -> None:
        """Finish the I/O in flight and stop the reactor (the client's copies may still end), waiting
        at most ``io_deadline`` for I/O that does not return (a stalled mount)."""
        if not self._stopped:
            self._stopped = True
            self.holders.close()  # a check hung on a stalled mount stays on its daemon thread
            self.io_stopped = self.reactor.close(timeout=self.config.io_deadline)
            if not self.io_stopped:
                log.warning("pykv worker %d: I/O to %s did not return within io_deadline (%.0f s); its staging "
                            "memory stays allocated until the process exits", self.engine.rank,
                            ", ".join(self.config.root_paths), self.config.io_deadline)

    def close(self) -> None:
        """Stop the reactor and free the staging memory (after the client's copier stopped); memory a
        read or write that never returned may still write into or read from is kept."""
        self.stop_io()
        if self.io_stopped:
            self.pool.close()

    # -- the DRAM tier -------------------------------------------------------------------------
    def _pool_slot(self, dram_slot: int | None) -> int | None:
        """The pool slot of a DRAM-tier slot (None: none, or one outside this worker's tier)."""
        if dram_slot is None or not 0 <= dram_slot < self.dram_slots:
            return None
        return self.dram_base + dram_slot

    def _serve_from_dram(self, part: Part, blocks: list[LoadBlock]) -> None:
        """Blocks sitting in their DRAM-tier slots: no I/O, so no reactor. Each slot's header is
        checked here and every block goes to the client as one batch (one batched copy on CUDA).
        The slots are safe to read: the scheduler pinned these keys until the load completes."""
        failed, sizes, copies = {}, {}, []
        for index, block in enumerate(blocks):
            try:
                header = slot_header(self.pool, block.slot, block)
            except FormatError as exc:
                failed[index] = BlockFailure(Step.CHECK, detail=exc.reason)
                continue
            sizes[index] = header.file_size
            with self._lock:
                job, job_index = self.ledger.locate(part.id, index)
            copies.append(SlotCopy(job, job_index, block.slot, header.payload_length, block.target, token=index,
                                   codec=header.codec, decoded_length=header.raw_length))
        copy_failed: set[int] = set()
        remaining = [len(copies)]

        def copied(copy: SlotCopy, ok: bool, failure: BlockFailure | None = None) -> None:  # any thread
            with self._lock:
                if not ok:
                    copy_failed.add(copy.token)
                    self.ledger.copy_failed(part.id, copy.token, failure)
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._dram_part_done(part, failed, sizes, copy_failed)

        if copies:
            self.client.from_slots(copies, copied)
        else:
            self._dram_part_done(part, failed, sizes, copy_failed)

    def _dram_part_done(self, part: Part, failed: dict[int, BlockFailure], sizes: dict[int, int],
                        copy_failed: set[int]) -> None:
        delivered = [size for index, size in sizes.items() if index not in copy_failed]
        self.counters[C.DRAM_DELIVERED_BLOCKS] += len(delivered)
        self.counters[C.DRAM_DELIVERED_BYTES] += sum(delivered)
        self._part_ended(part.id, failed, sum(delivered))

    # -- the reactor's callbacks (reactor thread) -------------------------------------------------
    def _may_copy(self, items: list, refuse: Callable[[object], None]) -> list:
        """``((job, index), item)`` for each of ``items`` (fill requests or ready blocks) whose part may
        still copy; ``refuse(item)`` for the others (a part given up: the engine may reuse its blocks)."""
        now = self._clock()
        with self._lock:
            allowed = [self.stalls.may_copy(i.job, i.index, now) for i in items]
            live = [(self.ledger.locate(i.job, i.index), i) for i, ok in zip(items, allowed) if ok]
        for item, ok in zip(items, allowed):
            if not ok:
                refuse(item)
        return live

    def fill(self, requests: list[FillRequest]) -> None:
        granted = self._may_copy(requests, lambda r: self.reactor.filled(r.transfer, False))
        if granted:
            self.client.to_slots([SlotCopy(job, index, r.slot, r.length, r.target, token=r)
                                  for (job, index), r in granted], self._filled)

    def _filled(self, copy: SlotCopy, ok: bool, stored: int | None = None) -> None:
        request: FillRequest = copy.token
        with self._lock:
            if self.ledger.filled(request.job, request.index, ok, request.length):
                self._lock.notify_all()
            settled = self.stalls.copy_ended(request.job, request.index, ok, self._clock())
        if settled:
            self._release_given_up(request.job)
        self.reactor.filled(request.transfer, ok, stored)

    def staged(self, part: object, index: int) -> None:
        """Block ``index`` of a store is whole in its slot, header included."""
        with self._lock:
            self.stalls.progress(part, self._clock())
            release = self.ledger.staged(part, self._clock())
        if release is not None:
            self.client.store_released(release)

    def deliver(self, blocks: list[ReadyBlock]) -> None:
        live = self._may_copy(blocks, lambda b: self.reactor.consumed(b.transfer))  # given up: recomputed
        if live:
            self.client.from_slots([SlotCopy(job, index, b.slot, b.header.payload_length, b.target, token=b,
                                             codec=b.header.codec, decoded_length=b.header.raw_length)
                                    for (job, index), b in live], self._delivered)

    def _delivered(self, copy: SlotCopy, ok: bool, failure: BlockFailure | None = None) -> None:
        block: ReadyBlock = copy.token
        with self._lock:
            if not ok:
                self.ledger.copy_failed(block.job, block.index, failure)
            settled = self.stalls.copy_ended(block.job, block.index, ok, self._clock())
        if settled:
            self._end_given_up_load(block.job)
        self.reactor.consumed(block.transfer)

    def _reactor_job_done(self, result: JobResult) -> None:
        with self._lock:
            dropped = self.stalls.given_up(result.job) and result.kind is Kind.LOAD  # ended when given up
            self.stalls.forget(result.job)
        if not dropped:
            self._part_ended(result.job, result.failed, result.bytes, result.published)

    # -- stalls ----------------------------------------------------------------------------------
    def check_stalls(self) -> None:
        """Give up the parts without progress for ``io_deadline`` (any thread; the client calls it
        often, e.g. on each poll for finished jobs; it does work at most every deadline / 8)."""
        now = self._clock()
        with self._lock:
            if now < self._stall_check_due:
                return
            self._stall_check_due = now + self.stalls.deadline / 8
            due = self.stalls.due(now)
            self.counters[C.LOAD_JOBS_GIVEN_UP] += sum(kind is Kind.LOAD for _, kind in due)
        for part, kind in due:
            log.warning("pykv worker %d: %s job %s made no progress in %.0f s (a stalled mount?); given up",
                        self.engine.rank, kind.value, part, self.stalls.deadline)
            if kind is Kind.LOAD:
                self._end_given_up_load(part)
            else:
                self._release_given_up(part)

    def _end_given_up_load(self, part: object) -> None:
        """A given-up load no copy is in flight for: every block not copied out failed (recomputed)."""
        with self._lock:
            if not self.stalls.settled(part) or not self.ledger.is_open(part):
                return
            end = self.ledger.part_ended(part, self.stalls.load_failures(part), 0, self._clock())
        if end is not None:
            self._carry_out(end)

    def _release_given_up(self, part: object) -> None:
        """A given-up store: its blocks without a fill never get one; the engine has it once none is filled."""
        with self._lock:
            if not self.stalls.settled(part):
                return
            release = self.ledger.give_up_store(part, sorted(self.stalls.refused(part)), self._clock())
            self._lock.notify_all()
        if release is not None:
            self.client.store_released(release)

    # -- ends ----------------------------------------------------------------------------------
    def _part_ended(self, part: object, failed: dict[int, BlockFailure], nbytes: int, published: int = 0) -> None:
        with self._lock:
            end = self.ledger.part_ended(part, failed, nbytes, self._clock(), published)
        if end is not None:
            self._carry_out(end)

    def _carry_out(self, end: JobEnd, *, on_lane: bool = False) -> None:
        """What the ledger decided at a job's end: quarantine, pause, tell the client. A quarantine blocks
        on a stalled mount: then all of it runs on a thread of the device (``Reactor.call_on_lane``)."""
        if end.quarantine and not on_lane:  # done=Outcome.get: an error raised there is logged
            lane = self.medium.first_lane(self.namespace.id, end.keys[end.quarantine[0]])
            return self.reactor.call_on_lane(lane, lambda: self._carry_out(end, on_lane=True), Outcome.get)
        for index in end.quarantine:
            self._quarantine(end.keys[index], end.failures[index])
        if end.pause is not None:
            self._pause_stores(end.pause)
        with self._lock:
            self._lock.notify_all()
        self.client.job_ended(end)

    def _quarantine(self, key: bytes, failure: BlockFailure) -> None:
        path = self.medium.locate(self.namespace.id, key)
        try:
            target = self.medium.quarantine(path, f"load-{socket.gethostname()}-{os.getpid()}")
            log.warning("pykv: %s: %s; moved to %s", path, failure, target)
        except FileNotFoundError:
            return
        except OSError as exc:  # e.g. a planted link at .pykv: never fall back to deleting what may not be ours
            log.warning("pykv: %s: %s; left in place, quarantine failed (%s); `pykv fsck` reports it", path,
                        failure, exc.strerror or exc)
            return
        with self._lock:
            self.counters[C.QUARANTINED] += 1

    def _pause_stores(self, failure: BlockFailure) -> None:
        if self.pause.begin(self._clock()):
            log.warning("pykv worker %d: stores to %s failing (%s); pausing stores for %.0f s, serving continues",
                        self.engine.rank, ', '.join(self.config.root_paths), failure, self.config.store_retry_interval)
            self.counters[C.STORE_PAUSES] += 1
