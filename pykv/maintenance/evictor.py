"""In-engine eviction: keep each device of a tree under ``max_tree_bytes`` while serving.

``TreeEvictor`` runs on its own daemon thread in the engine's scheduler process. It
checks the tree every ``evict_interval``, and at once after the engine stored half of
the gap between the limit and the low-water mark (``EvictionPolicy.trigger_bytes``).
A check is one round per device (the limit is per device: each device's share of the
tree is kept under it):

1. take the device's lease (``pykv.maintenance.lease``); another engine holds it: skip
   (that engine is evicting now), try again a quarter second later; what stands at its
   name that pykv did not write is moved to quarantine and the lease taken;
2. scan the device (through gc's catalog) and, when its blocks exceed the limit, delete
   least-recently-accessed blocks down to the low-water mark (90 % of the limit) with
   gc's own code (``gc.collect_scanned``: min age, re-stat before each unlink, only
   blocks pykv wrote, a vanished file counts as freed, ``gc.json`` records the round);
3. release the lease.

A round that ends with the device still over the limit (what is left is younger than
``evict_min_age``, or is not pykv's) makes the evictor ``behind``: the engine's
scheduler then stores nothing (counted, as on a full disk) until a round brings the
device under the limit again. Nothing here ever fails a store or a load: a deleted
block is a miss for its reader, and a failed round is logged and tried again.

Every round this engine runs (successful or failed; not one skipped for another engine's lease)
is recorded in the device's ``.pykv/evict.json`` (``pykv.maintenance.evict_record``), which
``pykv inspect`` and ``pykv doctor`` read; a failure to record is logged, never raised.

Each completed round also feeds the engine's gauges (``gauges``, a ``DeviceGauges``):
what it left on the device, and the device's quarantine, counted right after it (at most
once a minute per device: a walk of ``.pykv/quarantine``, which changes rarely).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from pykv.config import PykvConfig
from pykv.counters import Metric
from pykv.deviceset import DeviceSet
from pykv.maintenance.catalog import scan_tree
from pykv.maintenance.evict_record import EvictRecord, one_line, read_record, record_round
from pykv.maintenance.gauges import DeviceGauges
from pykv.maintenance.gc import collect_scanned
from pykv.maintenance.lease import Lease
from pykv.maintenance.quarantine import quarantine_usage
from pykv.maintenance.scan import Kind
from pykv.tree import KVTree
from pykv.units import format_size

log = logging.getLogger(__name__)

LOW_WATER = 0.9  # a round that evicts goes down to this fraction of the limit
RETRY_S = 0.25  # after a skipped round (another engine held the lease), check again this soon
MIN_LEASE_TTL_S = 30.0
QUARANTINE_EVERY_S = 60.0  # a device's quarantine is counted after a round at most this often


@dataclass(frozen=True)
class EvictionPolicy:
    """When and how far to evict: ``limit`` bytes per device, checked every ``interval_s``."""

    limit: int
    min_age_s: float
    interval_s: float

    @classmethod
    def of(cls, pykv: PykvConfig) -> "EvictionPolicy | None":
        """The policy of an engine with these settings; None where it evicts nothing (no
        ``max_tree_bytes``, or ``store`` false: it adds nothing to the tree)."""
        if not (pykv.max_tree_bytes and pykv.store):
            return None
        return cls(pykv.max_tree_bytes, pykv.evict_min_age, pykv.evict_interval)

    @property
    def low_water(self) -> int:
        return int(self.limit * LOW_WATER)

    @property
    def trigger_bytes(self) -> int:
        """Bytes this engine stores that start a round before the interval is up."""
        return max(1, (self.limit - self.low_water) // 2)

    @property
    def lease_ttl_s(self) -> float:
        """A lease not renewed for this long is stale (its holder crashed or hung); the evictor
        lengthens it to three times a device's last round where rounds take longer (the lease
        cuts it to ``MAX_TERM_S``)."""
        return max(3 * self.interval_s, MIN_LEASE_TTL_S)


@dataclass(frozen=True)
class RoundResult:
    """One round on one device, by the engine that held its lease."""

    root: str
    before_bytes: int
    after_bytes: int
    freed_files: int = 0
    freed_bytes: int = 0
    vanished_files: int = 0
    young_bytes: int = 0
    seconds: float = 0.0
    after_blocks: int = 0

    def within(self, limit: int) -> bool:
        return self.after_bytes <= limit


def evict_round(tree: KVTree, lease: Lease, policy: EvictionPolicy) -> RoundResult | None:
    """One round on ``tree`` under its lease; None when another engine holds the lease."""
    if not lease.acquire():
        return None
    try:
        started = time.monotonic()
        blocks = [e for e in scan_tree(tree).entries if e.kind is Kind.BLOCK]
        total = sum(e.size for e in blocks)
        if total <= policy.limit:
            return RoundResult(str(tree.root), total, total, seconds=time.monotonic() - started,
                               after_blocks=len(blocks))
        if not lease.renew():  # the scan outlived the lease: whoever holds it now evicts
            return None
        done = collect_scanned(tree, blocks, policy.low_water, min_age_s=policy.min_age_s, started=started)
        return RoundResult(str(tree.root), total, done.remaining_bytes, done.freed_files, done.freed_bytes,
                           done.vanished_files, done.young_bytes, done.seconds,
                           after_blocks=len(blocks) - done.freed_files - done.vanished_files)
    finally:
        lease.release()


class TreeEvictor:
    """Background eviction of one engine over its device set; see the module docstring. ``start``
    the thread, tell it what the engine stored (``note_stored``), read ``behind``, ``stats`` and ``gauges``."""

    def __init__(self, devices: DeviceSet, policy: EvictionPolicy, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.devices, self.policy = devices, policy
        self.gauges = DeviceGauges(len(devices))
        self.leases = [Lease(tree, ttl_s=policy.lease_ttl_s, clock=clock) for tree in devices]
        self._last_error: str | None = None
        self._round_seconds = [0.0] * len(self.leases)  # each device's last round: a lease outlives three
        self._quarantine_counted = [-QUARANTINE_EVERY_S] * len(self.leases)  # monotonic
        self._lock = threading.Lock()
        self._stored = 0
        self._behind = False
        self._counters: Counter[str] = Counter()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "TreeEvictor":
        self._thread = threading.Thread(target=self._run, name="pykv-evictor", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (a round in progress finishes first, up to ``timeout``)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def note_stored(self, nbytes: int) -> None:
        """The engine stored ``nbytes`` more (any thread): a round starts once they reach the trigger."""
        with self._lock:
            self._stored += nbytes
            due = self._stored >= self.policy.trigger_bytes
        if due:
            self._wake.set()

    @property
    def behind(self) -> bool:
        """Whether this engine's last round left a device over the limit (stores should pause)."""
        return self._behind

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {name: value for name, value in self._counters.items() if value}

    # -- rounds -------------------------------------------------------------------------------
    def run_once(self) -> list[RoundResult | None]:
        """Check every device once (the thread's work; tests call it directly): per device, its round,
        or None where another engine held the lease or the round failed."""
        with self._lock:
            stored, self._stored = self._stored, 0
        results = []
        for index, (tree, lease) in enumerate(zip(self.devices, self.leases)):
            lease.ttl_s = max(self.policy.lease_ttl_s, 3 * self._round_seconds[index])
            try:
                result = evict_round(tree, lease, self.policy)
            except Exception as exc:  # never let the thread die: log, count, try again next time
                message = f"pykv: eviction round on {tree.root} failed: {exc}"
                log.log(logging.DEBUG if message == self._last_error else logging.WARNING, message)
                self._last_error = message  # (the same failure again is not warned about every round)
                self._count(Metric.EVICT_ERRORS)
                self._record(tree, lease, None, exc)
                results.append(None)
                continue
            if result is None:
                self._count(Metric.EVICT_LEASE_SKIPS)
            else:
                self._last_error = None
                self._round_seconds[index] = result.seconds
                self._round_done(result)
                self._gauge(index, tree, result)
                self._record(tree, lease, result, None)
            results.append(result)
        if any(r is None for r in results):
            with self._lock:
                self._stored += stored  # not yet covered by a round of ours: retry soon
                due = self._stored >= self.policy.trigger_bytes
            if due:
                self._wake.set()
        rounds = [r for r in results if r is not None]
        if rounds:
            self._set_behind(not all(r.within(self.policy.limit) for r in rounds), rounds)
        return results

    def _round_done(self, result: RoundResult) -> None:
        with self._lock:
            self._counters[Metric.EVICT_ROUNDS] += 1
            self._counters[Metric.EVICTED_BLOCKS] += result.freed_files
            self._counters[Metric.EVICTED_BYTES] += result.freed_bytes
        if result.freed_files or not result.within(self.policy.limit):
            log.info("pykv: eviction round on %s: %d blocks, %s freed in %.2f s; %s -> %s (limit %s, low water %s)",
                     result.root, result.freed_files, format_size(result.freed_bytes), result.seconds,
                     format_size(result.before_bytes), format_size(result.after_bytes), format_size(self.policy.limit),
                     format_size(self.policy.low_water))
        else:
            log.debug("pykv: eviction check on %s: %s within %s", result.root, format_size(result.before_bytes),
                      format_size(self.policy.limit))

    def _record(self, tree: KVTree, lease: Lease, result: RoundResult | None, error: BaseException | None) -> None:
        """Publish the round's ``evict.json``: a failed one keeps the last success the file holds."""
        now, policy = time.time(), self.policy
        try:
            if result is not None:
                record = EvictRecord(now, now, not result.within(policy.limit), result.after_bytes, policy.limit,
                                     policy.interval_s, None, lease.holder)
            else:
                last = read_record(tree, now)
                last = last if isinstance(last, EvictRecord) else None
                record = EvictRecord(now, last.ok_at if last else None, last.behind if last else False,
                                     last.tree_bytes if last else 0, policy.limit, policy.interval_s,
                                     one_line(error or "failed"), lease.holder)
            record_round(tree, record)
        except OSError as exc:
            log.debug("pykv: cannot record the eviction round in %s: %s", tree.root, exc)

    def _gauge(self, index: int, tree: KVTree, result: RoundResult) -> None:
        """Record the round and, when due (``QUARANTINE_EVERY_S``), count the device's quarantine (NaN where
        it cannot be read)."""
        self.gauges.round_done(index, result.after_blocks, result.after_bytes, not result.within(self.policy.limit))
        now = time.monotonic()
        if now - self._quarantine_counted[index] < QUARANTINE_EVERY_S:
            return
        self._quarantine_counted[index] = now
        try:
            usage = quarantine_usage(tree)
        except OSError as exc:
            log.debug("pykv: cannot count the quarantine of %s: %s", tree.root, exc)
            usage = None
        self.gauges.quarantine_counted(index, usage)

    def _set_behind(self, behind: bool, rounds: list[RoundResult]) -> None:
        if behind and not self._behind:
            worst = max(rounds, key=lambda r: r.after_bytes - self.policy.limit)
            log.warning("pykv: %s is still %s over max_tree_bytes after eviction (%s younger than evict_min_age); "
                        "stores pause until eviction brings it under the limit", worst.root,
                        format_size(worst.after_bytes - self.policy.limit), format_size(worst.young_bytes))
        elif self._behind and not behind:
            log.info("pykv: the tree is within max_tree_bytes again; stores resume")
        self._behind = behind

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.policy.interval_s)
            self._wake.clear()
            if self._stopping.is_set():
                return
            if None in self.run_once() and self._stopping.wait(min(RETRY_S, self.policy.interval_s)):
                return  # (after a skip, retries are paced: the lease holder is evicting now)

