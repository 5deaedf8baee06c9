"""``PykvManager``: the scheduler-side half of pykv (vLLM's ``OffloadingManager``).

Called from the engine core's scheduler loop only (one thread). It answers
lookups from the DRAM index and the file tree (rank 0's namespace), hands the
worker plain instructions in ``PykvLoadSpec``/``PykvStoreSpec``, and decides every
DRAM slot assignment itself (deterministically, like vLLM's CPU tier assigns CPU
chunk ids) so the worker processes need no shared state.

Truth about the disk is the disk: a key is a disk hit only when its final file
exists, which happens only after a worker published it. Failures come back from
the workers as ``WorkerReport``s (``on_worker_report``) no later than the job's
completion, so a key whose load failed is forgotten before vLLM retries the
request and the retry misses instead of looping.

Early release (one worker): a store whose blocks all have DRAM slots ends, for
vLLM, as soon as the blocks are in those slots; ``complete_store`` then makes them
DRAM hits at once, and keeps each slot pinned while the worker still writes the
file from it, until the worker's ``stores_ended`` says the write is over (either
message may come first).

Cache reset (``reset_cache``): the DRAM tier is forgotten at once, but a slot that a
transfer in flight still writes or reads (a pending store or promotion, a DRAM hit
being copied, an early-released write) stays taken, invalidated, until the workers
are done with it: until ``on_reset_flushed`` (vLLM reports every job in flight at
the reset finished; 33+, and pykv's connector backports it to older vLLM) and, for
a slot a file is still written from, the worker's ``stores_ended``. A fenced key is
neither stored nor promoted again meanwhile, so each end report names one transfer.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Collection

from pykv.calibration import BreakEvenGate
from pykv.preload import PreloadPlan, PreloadPlanner
from pykv.tiers import DramIndex
from pykv.tree import KVTree, TreeOptions

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
from pykv.connector.layout import early_release_enabled, namespace_for, slot_bytes, slot_counts
from pykv.connector.spec import NO_SLOT, Metric, PykvLoadSpec, PykvStoreSpec, WorkerReport
from pykv.counters import CounterFile

log = logging.getLogger(__name__)



class PykvManager(OffloadingManager):
    """Lookups, load/store preparation and the DRAM index; see the module docstring."""

    def __init__(self, config: OffloadingConfig, pykv: PykvConfig, *, clock=time.monotonic) -> None:
        self.config, self.pykv, self._clock = config, pykv, clock
        self.namespace = namespace_for(config, rank=0)
        self.tree = KVTree.create(pykv.root, TreeOptions(pykv.file_mode, pykv.dir_mode, pykv.fsync))
        try:
            self.tree.ensure_namespace(self.namespace)
        except OSError as exc:  # a read-only tree can still serve loads
            log.warning("pykv: cannot prepare namespace %s in %s (%s)", self.namespace.id, pykv.root, exc)
        _, dram_slots = slot_counts(pykv, config)
        self.dram = DramIndex(dram_slots, pykv.dram_policy)
        self._pending_stores: set[bytes] = set()
        self.early_release = early_release_enabled(config)
        self._writing: set[bytes] = set()  # committed DRAM entries whose file a worker still writes from the slot
        self._ended: set[bytes] = set()  # writes reported ended before vLLM completed their store
        self._drop_when_written: set[bytes] = set()  # invalidated while written: dropped when the write ends
        self._reset_fenced: set[bytes] = set()  # in flight at a cache reset: dropped at on_reset_flushed
        self._load_tiers: tuple[str | None, dict[bytes, str]] = (None, {})  # the last prepare_load's tiers
        self._stores_paused_until = 0.0
        self.preloads = PreloadPlanner(pykv.preload_look_ahead, pykv.preload_max_bytes // slot_bytes(config)) \
            if pykv.preload else None
        self.counters: Counter[str] = Counter()
        self._reported: Counter[str] = Counter()
        self._stats_file = CounterFile("scheduler")
        self.gate = None if not pykv.breakeven_file else BreakEvenGate.from_file(
            pykv.breakeven_file, self.namespace.describe(), override=pykv.breakeven_override,
            setting="kv_connector_extra_config.breakeven_file", margin=pykv.breakeven_margin)
        self._gate_refused: str | None = None  # the request whose lookups the gate answers MISS
        self._gate_request: str | None = None  # the request the gate looked at last, and what it found:
        self._gate_tiers: dict[bytes, str | None] = {}  # vLLM's lookups right after reuse it
        log.info("pykv: tree %s, namespace %s, DRAM tier %d slots (%s)", pykv.root, self.namespace.id,
                 dram_slots, pykv.dram_policy if dram_slots else "off")

    # -- lookups and loads ---------------------------------------------------------------------
    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        if self._gate_refused is not None and req_context.req_id == self._gate_refused:
            return LookupResult.MISS
        if req_context.req_id == self._gate_request and key in self._gate_tiers:
            tier = self._gate_tiers[key]  # the gate just looked: no second stat per block
        else:
            tier = self._tier_of(key)
        return LookupResult.MISS if tier is None else LookupResult.HIT

    def _tier_of(self, key: bytes) -> str | None:
        if self.dram.lookup(key) is not None:
            return "dram"
        return "disk" if self.tree.contains(self.namespace.id, key) else None

    def gate_request(self, req_id: str, groups: list[tuple[int, list[bytes]]], num_computed_tokens: int) -> None:
        """Before a request's lookups (connector hook): refuse its load if the reusable prefix is
        below its tier's break-even length; ``lookup`` then answers MISS for it and vLLM recomputes."""
        self._gate_refused = None
        self._gate_request, self._gate_tiers = req_id, {}
        if self.gate is None:
            return
        tiers = self._gate_tiers

        def tier_of(key: bytes) -> str | None:
            if key not in tiers:
                tiers[key] = self._tier_of(key)
            return tiers[key]

        decision = self.gate.decide(groups, num_computed_tokens, tier_of)
        if not decision.admitted:
            self._gate_refused = req_id
            self.counters[Metric.GATE_REFUSALS] += 1
            self.counters[Metric.GATE_REFUSED_TOKENS] += decision.hit_tokens
            self._write_stats()

    def prepare_load(self, keys: Collection[bytes], req_context: ReqContext) -> PykvLoadSpec:
        """DRAM hits are pinned and served from their slot; disk hits get their atime stamped
        (gc recency) and, with a DRAM tier, a pending slot to be promoted into."""
        slots, resident, tiers = [], [], {}
        for key in keys:
            slot = self.dram.lookup(key)
            if slot is not None:
                self.dram.pin(key)
                self.dram.touch([key])
                slots.append(slot)
                resident.append(True)
                tiers[key] = "dram"
                self.counters[Metric.HITS_DRAM] += 1
                continue
            tiers[key] = "disk"
            self.tree.touch(self.tree.block_path(self.namespace.id, key))
            self.counters[Metric.HITS_DISK] += 1
            slot = self._promotion_slot(key)
            slots.append(slot)
            resident.append(False)
        self._preload_done(req_context.req_id)
        self._load_tiers = (req_context.req_id, tiers)
        self._write_stats()
        return PykvLoadSpec(list(keys), slots, resident, req_id=req_context.req_id)

    def get_load_source(self, key: bytes, req_context: ReqContext) -> Any:
        """The tier a hit is loaded from (vLLM labels the request's cached tokens with it): host
        memory for a DRAM hit, disk for a file (as ``prepare_load`` found it, which vLLM has
        just called for this request)."""
        req_id, tiers = self._load_tiers
        tier = tiers.get(key) if req_id == req_context.req_id else None
        return compat.cache_hit_source(tier or self._tier_of(key))

    def _promotion_slot(self, key: bytes) -> int:
        if self.dram.capacity == 0 or key in self.dram:
            return NO_SLOT
        # A block being preloaded is promoted too: the reactor copies it from the preload's
        # staging slot into this one (one read). Without it, every later hit of a preloaded
        # prefix would read the disk again (H200 P40 run 5: 775 against 640 block reads).
        slot = self.dram.allocate(key)
        if slot is None:
            return NO_SLOT
        self.dram.pin(key)
        return slot

    def touch(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        self.dram.touch(keys)

    def complete_load(self, keys: Collection[bytes], req_context: ReqContext) -> None:
        """Unpin; promotions become valid (a failed one was dropped by ``on_worker_report``)."""
        for key in keys:
            entry = self.dram.entry(key)
            if entry is not None and key not in self._reset_fenced:  # fenced: a pre-reset transfer's entry
                self.dram.unpin(key)
                if key not in self._drop_when_written:  # forgotten while still written: stays a miss
                    self.dram.commit(key)
        self._write_stats()

    # -- stores --------------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[bytes], req_context: ReqContext) -> PrepareStoreOutput:
        """Skip keys already on disk, in DRAM or being stored; while stores are paused, or when this
        instance only loads (``store`` false), store nothing."""
        keys = list(keys)
        refused = Metric.STORES_OFF if not self.pykv.store else \
            Metric.STORES_DISABLED if self._clock() < self._stores_paused_until else None
        if refused:
            self.counters[refused] += len(keys)
            self._write_stats()
            return PrepareStoreOutput(keys_to_store=[], store_spec=PykvStoreSpec([]), evicted_keys=[])
        to_store, slots = [], []
        for key in keys:
            if key in self._pending_stores or key in self.dram or self.tree.contains(self.namespace.id, key):
                # (a key fenced by a cache reset keeps its DRAM entry until its transfer ends)
                self.counters[Metric.STORE_SKIPPED] += 1
                continue
            self._pending_stores.add(key)
            slot = NO_SLOT
            if self.dram.capacity:
                allocated = self.dram.allocate(key)
                if allocated is not None:
                    self.dram.pin(key)
                    slot = allocated
            to_store.append(key)
            slots.append(slot)
        self._write_stats()
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=PykvStoreSpec(to_store, slots),
                                  evicted_keys=[])

    def complete_store(self, keys: Collection[bytes], req_context: ReqContext, success: bool = True) -> None:
        """DRAM entries become hits; with early release a slot stays pinned until its write ends."""
        for key in keys:
            self._pending_stores.discard(key)
            if self.dram.entry(key) is None:
                self._ended.discard(key)
                continue
            if not success:
                self._release_write(key)
                self.dram.drop(key)
                continue
            self.dram.commit(key)
            if not self.early_release or key in self._ended:
                self._ended.discard(key)
                self.dram.unpin(key)
            else:
                self._writing.add(key)
        self._write_stats()

    def _release_write(self, key: bytes) -> None:
        """The write from ``key``'s DRAM slot is over: unpin it (or drop it, if invalidated meanwhile)."""
        if key in self._writing:
            self._writing.discard(key)
            self.dram.unpin(key)
            if key in self._drop_when_written:
                self._drop_when_written.discard(key)
                if key not in self._reset_fenced:
                    self.dram.drop(key)
        elif key in self._pending_stores:  # vLLM has not completed the store yet
            self._ended.add(key)

    # -- worker feedback -----------------------------------------------------------------------
    def on_worker_report(self, report: WorkerReport) -> None:
        """Apply a worker's failures. Called before vLLM's ``complete_*`` of the same step."""
        for key in report.failed_loads:
            self._forget(key)
            self.counters[Metric.LOAD_FAILURES] += 1
        for key in report.stores_ended:
            self._release_write(key)
        for key, dram_ok in report.failed_stores:
            self.counters[Metric.STORE_FAILURES] += 1
            if not dram_ok and key in self._reset_fenced:
                self._writing.discard(key)  # that store is over: its slot waits for the flush only
            elif not dram_ok:
                self._forget(key)
        if report.store_error and self._clock() >= self._stores_paused_until:
            self._stores_paused_until = self._clock() + self.pykv.store_retry_interval
            log.warning("pykv: stores to %s failing (%s); pausing stores for %.0f s, serving continues",
                        self.pykv.root, report.store_error, self.pykv.store_retry_interval)
        self._write_stats()

    def _forget(self, key: bytes) -> None:
        """Drop ``key``'s DRAM entry; one a worker still writes from misses from now on and
        keeps its slot until that write ends (one fenced by a reset is already a miss)."""
        if key in self._reset_fenced:
            return
        if key in self._writing:
            self.dram.invalidate(key)
            self._drop_when_written.add(key)
        else:
            self.dram.drop(key)

    # -- preloading (connector hooks; see pykv.preload) ------------------------------------------
    def preload_candidate(self, req_id: str, keys: list[bytes]) -> None:
        """A request entered vLLM's waiting queue with these block keys (in order)."""
        if self.preloads is not None:
            self.preloads.waiting(req_id, keys)

    def take_preload_plan(self) -> PreloadPlan:
        """Once per scheduler step: blocks to read ahead for waiting requests, requests to drop."""
        if self.preloads is None:
            return PreloadPlan()
        plan = self.preloads.plan(self._tier_of)
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
        """Forget the DRAM tier. Slots a transfer in flight still uses stay taken (misses) until
        ``on_reset_flushed``; slots a file is still written from, also until that write ends."""
        in_flight = set(self.dram.in_use())
        if self.early_release:  # a pending store's write may go on after vLLM's job ends
            self._writing |= {k for k in self._pending_stores if k in in_flight and k not in self._ended}
        self._reset_fenced |= in_flight
        self.dram.clear(keep=in_flight | self._writing)
        self._drop_when_written = set(self._writing)
        self._pending_stores.clear()
        self._ended.clear()
        self._load_tiers = (None, {})

    def on_reset_flushed(self) -> None:
        """(vLLM 33+; pykv's connector on older vLLM.) Workers finished every job in flight at the
        last reset: free the slots those jobs used, except slots a file is still written from."""
        fenced, self._reset_fenced = self._reset_fenced, set()
        for key in fenced:
            if key not in self._writing:
                self.dram.drop(key)
        self._write_stats()

    def config_info(self) -> list[dict[str, Any]]:
        """(vLLM 33+.) Static facts for ``vllm:kv_offload_config_info``; keys: ``CONFIG_INFO_KEYS``."""
        return [{"pykv_root": str(self.pykv.root), "pykv_namespace": self.namespace.id,
                 "pykv_dram_slots": self.dram.capacity, "pykv_dram_policy": self.pykv.dram_policy,
                 "pykv_io_engine": str(self.pykv.io_engine), "pykv_verify": str(self.pykv.verify),
                 "pykv_store": bool(self.pykv.store), "pykv_preload": bool(self.pykv.preload)}]

    def get_stats(self):
        """pykv's counters since the last call, as vLLM ``OffloadingConnectorStats``."""
        delta = self.counters - self._reported
        if not delta:
            return None
        self._reported = Counter(self.counters)
        stats = compat.new_stats()
        for name, value in delta.items():
            stats.increase_counter(name, value)
        return stats

    def _write_stats(self) -> None:
        if not self._stats_file.enabled:
            return
        self._stats_file.write({**self.counters, "dram_entries": len(self.dram),
                                "pending_stores": len(self._pending_stores)})
