"""``PykvManager``: the scheduler-side half of pykv (vLLM's ``OffloadingManager``).

A translator, called from the engine core's scheduler loop only (one thread): it
answers vLLM's lookups and plans its loads and stores through ``pykv.block_index.BlockIndex``
(a request's survey over the DRAM tier and the file tree of every rank's namespace, the
break-even gate, the load plan's tiers, which blocks a store writes), turns
``prepare_*``/``complete_*``, cache resets and the workers' ``WorkerReport``s into events
of ``pykv.residency.DramResidency`` (the pure ledger that decides every DRAM slot
assignment, so the worker processes need no shared state), and hands the workers plain
instructions in ``PykvLoadSpec``/``PykvStoreSpec``.

Truth about the disk is the disk: a key is a disk hit only when the final file of
every worker (each rank writes its own shard under its own namespace) exists, which
happens only after each of them published it, so a hit never sends a rank to a file
its store failed to write. With several workers, vLLM merges their reports into one
per step (``PykvWorkerMetadata.aggregate``); each write end names its rank, and a DRAM
slot is reused only after every rank's end arrived. Failures come back from
the workers no later than the job's completion (``on_worker_report`` is called
before vLLM's ``complete_*`` of the same step), so a key whose load failed is
forgotten before vLLM retries the request and the retry misses instead of looping.
A store the medium refused pauses stores here too (``StorePause``). With
``max_tree_bytes`` the manager runs the engine's ``TreeEvictor`` (its own thread),
stores nothing while the evictor is behind, and passes on its per-device gauges.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Collection

from pykv.auth import load_key_ring
from pykv.block_index import BlockIndex, StoreRefusal
from pykv.calibration import BreakEvenGate
from pykv.maintenance.evictor import EvictionPolicy, TreeEvictor
from pykv.maintenance.gauges import GaugeSample
from pykv.counters import CounterFile, Metric, SchedulerCounter
from pykv.preload import PreloadPlan, PreloadPlanner
from pykv.residency import DramResidency, StorePause, Tier
from pykv.presence import DiskPresence
from pykv.store import open_devices
from pykv.tiers import DramIndex

from pykv.connector import compat
from pykv.connector.compat import (
    LookupResult,
    OffloadingConfig,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from pykv.config import PykvConfig
from pykv.connector.codecs import engine_codec
from pykv.connector.layout import namespace_for, slot_bytes, slot_counts
from pykv.connector.messages import NO_SLOT, PykvLoadSpec, PykvStoreSpec, WorkerReport

log = logging.getLogger(__name__)

GAUGE_REPORT_S = 1.0  # the evictor's gauges go to vLLM at most this often (with a step's stats)


def _roots(pykv: PykvConfig) -> str:
    """The tree's directories as one string (logs and the engine's config info)."""
    return ", ".join(pykv.root_paths)


def _slot_or_none(slot: int | None) -> int:
    return NO_SLOT if slot is None else slot


class PykvManager(OffloadingManager):
    """Lookups, load/store preparation and the DRAM tier's slots; see the module docstring."""

    def __init__(self, config: OffloadingConfig, pykv: PykvConfig, *, clock=time.monotonic) -> None:
        self.config, self.pykv, self._clock = config, pykv, clock
        # each rank's KV shard lives in its own namespace; rank 0's names the engine (gate, logs)
        codec = engine_codec(pykv, compat.kv_cache_dtype(config)).params  # the workers' (a codec is a namespace of its own)
        self.rank_namespaces = tuple(namespace_for(config, rank=r, codec=codec)
                                     for r in range(max(config.parallel.world_size, 1)))
        self.namespace = self.rank_namespaces[0]
        self.devices = open_devices(pykv)
        # existence checks and access stamps, on each device's threads, answered within lookup_deadline
        self.presence = DiskPresence(self.devices, [ns.id for ns in self.rank_namespaces], pykv.lookup_deadline)
        try:
            self.devices.ensure_namespace(self.namespace)
        except OSError as exc:  # a read-only tree can still serve loads
            log.warning("pykv: cannot prepare namespace %s in %s (%s)", self.namespace.id, _roots(pykv), exc)
        _, dram_slots = slot_counts(pykv, config)
        self.residency = DramResidency(dram_slots, pykv.dram_policy, early_release=True,
                                       workers=len(self.rank_namespaces))
        self.store_pause = StorePause(pykv.store_retry_interval)
        self.preloads = PreloadPlanner(pykv.preload_look_ahead, pykv.preload_max_bytes // slot_bytes(config)) \
            if pykv.preload else None
        self.counters: Counter[str] = Counter()
        self.timing: Counter[str] = Counter()  # counter file only (SchedulerCounter), not vLLM's stats
        self._block_bytes = slot_bytes(config)  # what one stored block adds to the tree, at most
        policy = EvictionPolicy.of(pykv)
        self.evictor = TreeEvictor(self.devices, policy).start() if policy else None
        self._reported: Counter[str] = Counter()
        self._gauges_reported = -GAUGE_REPORT_S  # on ``clock``
        self._stats_file = CounterFile("scheduler")
        self.gate = None if not pykv.breakeven_file else BreakEvenGate.from_file(
            pykv.breakeven_file, {**self.namespace.describe(), "codec": self.namespace.codec},
            override=pykv.breakeven_override,
            setting="kv_connector_extra_config.breakeven_file", margin=pykv.breakeven_margin)
        if pykv.auth_key_file:  # checked at start (the workers hold the keys): a bad key file stops the engine
            ring = load_key_ring(pykv.auth_key_file)
            log.info("pykv: authenticated blocks, %s", ring)
        self.index = BlockIndex(self.residency, self.presence, self.gate, counters=self.counters, timing=self.timing)
        log.info("pykv: tree %s, namespace %s, DRAM tier %d slots (%s)", _roots(pykv), self.namespace.id,
                 dram_slots, pykv.dram_policy if dram_slots else "off")

    @property
    def dram(self) -> DramIndex:
        """The DRAM tier's index (its slots, pins and eviction order)."""
        return self.residency.index

    @property
    def early_release(self) -> bool:
        return self.residency.early_release

    # -- lookups and loads (the block index's) -------------------------------------------------
    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.index.lookup(req_context.req_id, key) else LookupResult.MISS

    def tier_of(self, key: bytes) -> Tier | None:
        """Where a load of ``key`` would come from now (None: a miss)."""
        return self.index.tier_of(key)

    def on_disk(self, key: bytes) -> bool:
        """Whether every rank's file of ``key`` is published (one stat per rank; a device that does not
        answer within ``lookup_deadline`` counts as a miss)."""
        return self.index.on_disk(key)

    def survey_request(self, req_id: str, groups: list[tuple[int, list[bytes]]], num_computed_tokens: int) -> None:
        """Before a request's lookups (connector hook): ``BlockIndex.survey`` (where its blocks are, the
        disk checks at once on ``presence``'s threads; with a gate, whether its load is refused)."""
        if self.index.survey(req_id, groups, num_computed_tokens):
            self._write_stats()

    def prepare_load(self, keys: Collection[bytes], req_context: ReqContext) -> PykvLoadSpec:
        """``BlockIndex.plan_load``: DRAM hits pinned, disk hits stamped and promoted into a pending slot."""
        plan = self.index.plan_load(req_context.req_id, keys)
        self._preload_done(req_context.req_id)
        self._write_stats()
        return PykvLoadSpec(list(plan.keys), [_slot_or_none(s) for s in plan.slots], list(plan.resident),
                            req_id=req_context.req_id)

    def get_load_source(self, key: bytes, req_context: ReqContext) -> Any:
        """The tier a hit is loaded from (vLLM labels the request's cached tokens with it)."""
        return compat.cache_hit_source(self.index.load_source(req_context.req_id, key))

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        self.residency.touch(keys)

    def complete_load(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        """Unpin; promotions become valid (a failed one was dropped by ``on_worker_report``)."""
        self.residency.loads_ended(keys)
        self._write_stats()

    # -- stores --------------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[bytes], req_context: ReqContext) -> PrepareStoreOutput:
        """``BlockIndex.plan_store``: keys already on disk, in DRAM or being stored are skipped; while
        stores are paused, the tree is over its limit, or this instance only loads, nothing is stored."""
        plan = self.index.plan_store(keys, self._store_refusal())
        self._write_stats()
        return PrepareStoreOutput(keys_to_store=list(plan.keys),
                                  store_spec=PykvStoreSpec(plan.keys, [_slot_or_none(s) for s in plan.slots]),
                                  evicted_keys=[])

    def _store_refusal(self) -> StoreRefusal | None:
        """Why this engine stores nothing now (``store`` false, a store pause, the evictor behind), or None."""
        if not self.pykv.store:
            return StoreRefusal.OFF
        if self.store_pause.active(self._clock()):
            return StoreRefusal.PAUSED
        if self.evictor is not None and self.evictor.behind:
            return StoreRefusal.OVER_LIMIT
        return None

    def complete_store(self, keys: Collection[bytes], req_context: ReqContext, success: bool = True) -> None:
        """DRAM entries become hits; a slot stays pinned until every worker's write from it ended."""
        self.residency.store_completed(keys, success)
        if success:
            self.counters[Metric.STORED_BLOCKS] += len(keys)
        if self.evictor is not None and success:
            self.evictor.note_stored(len(keys) * self._block_bytes)
        self._write_stats()

    # -- worker feedback -----------------------------------------------------------------------
    def on_worker_report(self, report: WorkerReport) -> None:
        """Apply a worker's failures. Called before vLLM's ``complete_*`` of the same step."""
        for key in report.failed_loads:
            self.residency.load_failed(key)
            self.counters[Metric.LOAD_FAILURES] += 1
        for key, rank in report.stores_ended:
            self.residency.write_ended(key, rank)
        for key, dram_ok in report.failed_stores:
            self.counters[Metric.STORE_FAILURES] += 1
            self.residency.store_failed(key, dram_ok)
        if report.store_error and self.store_pause.begin(self._clock()):
            log.warning("pykv: stores to %s failing (%s); pausing stores for %.0f s, serving continues",
                        _roots(self.pykv), report.store_error, self.pykv.store_retry_interval)
        self._write_stats()

    # -- preloading (connector hooks; see pykv.preload) ------------------------------------------
    def preload_candidate(self, req_id: str, keys: list[bytes]) -> None:
        """A request entered vLLM's waiting queue with these block keys (in order)."""
        if self.preloads is not None:
            self.preloads.waiting(req_id, keys)

    def take_preload_plan(self) -> PreloadPlan:
        """Once per scheduler step: blocks to read ahead for waiting requests, requests to drop."""
        if self.preloads is None:
            return PreloadPlan()
        plan = self.preloads.plan(self.tier_of)
        if plan.preloads:
            self.counters[Metric.PRELOAD_REQUESTS] += len(plan.preloads)
            self.counters[Metric.PRELOAD_BLOCKS] += sum(len(keys) for keys in plan.preloads.values())
            self._write_stats()
        return plan

    def on_schedule_end(self, context) -> None:
        for req_id in getattr(context, "new_req_ids", ()):
            self._preload_done(req_id)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._preload_done(req_context.req_id)

    def _preload_done(self, req_id: str) -> None:
        """The request left the waiting queue (scheduled, loading, finished, aborted)."""
        if self.preloads is not None:
            self.preloads.remove(req_id)

    # -- vLLM bookkeeping ----------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(policy=compat.DEFAULT_OFFLOAD_POLICY)

    def reset_cache(self) -> None:
        """Forget the DRAM tier (slots a transfer in flight still uses stay taken; ``DramResidency.reset``)."""
        self.residency.reset()
        self.index.reset()

    def on_reset_flushed(self) -> None:
        """(vLLM 33+; pykv's connector on older vLLM.) Workers finished every job in flight at the
        last reset: free the slots those jobs used, except slots a file is still written from."""
        self.residency.reset_flushed()
        self._write_stats()

    def config_info(self) -> list[dict[str, Any]]:
        """(vLLM 33+.) Static facts for ``vllm:kv_offload_config_info``; keys: ``CONFIG_INFO_KEYS``."""
        return [{"pykv_root": _roots(self.pykv), "pykv_namespace": self.namespace.id,
                 "pykv_dram_slots": self.dram.capacity, "pykv_dram_policy": self.pykv.dram_policy,
                 "pykv_io_engine": str(self.pykv.io_engine), "pykv_verify": str(self.pykv.verify),
                 "pykv_store": bool(self.pykv.store), "pykv_preload": bool(self.pykv.preload)}]

    def get_stats(self):
        """pykv's counters since the last call and, when due, the evictor's gauges (``GAUGE_REPORT_S``),
        as vLLM ``OffloadingConnectorStats``. Called once per engine step."""
        self._take_thread_counters()
        delta = self.counters - self._reported
        gauges = self._due_gauges()
        if not delta and not gauges:
            return None
        self._reported = Counter(self.counters)
        stats = compat.new_stats()
        for name, value in delta.items():
            stats.increase_counter(name, value)
        for sample in gauges:
            compat.set_gauge(stats, str(sample.gauge), sample.value, sample.labels)
        return stats

    def _due_gauges(self) -> list[GaugeSample]:
        """The evictor's per-device gauges (none without one: they keep their start values)."""
        now = self._clock()
        if self.evictor is None or now - self._gauges_reported < GAUGE_REPORT_S:
            return []
        self._gauges_reported = now
        return self.evictor.gauges.samples()

    def _take_thread_counters(self) -> None:
        if self.evictor is not None:
            for name, value in self.evictor.stats().items():  # the evictor's totals (its own thread counts them)
                self.counters[name] = value
        self.counters[Metric.LOOKUPS_UNANSWERED] = self.presence.unanswered

    def shutdown(self) -> None:
        """vLLM's hook at engine shutdown (``OffloadingManager.shutdown``; idempotent): the evictor
        finishes a round in progress, which releases its lease, and stops. vLLM's multiprocess
        engine core is often killed before it calls this; a round killed with it leaves its lease
        until expiry and, on local file systems, no temp (``pykv.io.small_files``)."""
        if self.evictor is not None:
            self.evictor.close()
        self.presence.close()
        self._write_stats()
        self._stats_file.flush()

    def _write_stats(self) -> None:
        if not self._stats_file.enabled:
            return
        self._take_thread_counters()
        self._stats_file.write({**self.counters, **self.timing, SchedulerCounter.DRAM_ENTRIES: len(self.residency),
                                SchedulerCounter.PENDING_STORES: self.residency.pending_stores})
