"""pykv's counters and gauges: their names, what each means, and the counter files that carry them out.

What vLLM exports (``get_stats``, Prometheus ``/metrics``; ``prometheus_names`` lists the samples):

- ``Metric``: the scheduler's counters, documented in ``METRIC_DOCS``;
- ``Gauge``: the scheduler's gauges, one per device of the tree (``pykv.maintenance.gauges``).

Each process's own counters:

- ``WorkerCounter`` and ``SchedulerCounter``: written to a counter file when
  ``PYKV_STATS_FILE`` is set. vLLM has no channel for worker-side counters and in its
  default multiprocess mode neither side runs in the caller's process, so the jobs that
  drive engines (calibrate, warm, demo, the end-to-end tests) read these files.

A counter file is ``$PYKV_STATS_FILE.<role>.json`` (roles ``scheduler``, ``worker0``,
``worker1``, ...), one JSON object of name to integer, replaced atomically (by a writer
thread, off the engine's step) whenever the process's counters change. ``read_counters``
reads them back bounded and tolerant: a file that is missing, half written, oversized or
not an object of integers is skipped.
"""

from __future__ import annotations

import atexit
import enum
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from pykv.io.atomic import write_atomically

log = logging.getLogger(__name__)

ENV = "PYKV_STATS_FILE"
MAX_FILE_BYTES = 1 << 20  # a counter file is a few KiB; anything larger is not one


class _Documented(enum.StrEnum):
    """A counter name that carries its one-line meaning (``.doc``)."""

    doc: str

    def __new__(cls, value: str, doc: str) -> "_Documented":
        member = str.__new__(cls, value)
        member._value_ = value
        member.doc = doc
        return member


class Metric(_Documented):
    """The scheduler counters vLLM exports (names as they appear in ``/metrics``)."""

    HITS_DRAM = "pykv:load_hits_dram", "Storage blocks loaded from pykv's DRAM tier (no disk read)."
    HITS_DISK = "pykv:load_hits_disk", "Storage blocks loaded from the pykv file tree."
    LOAD_FAILURES = ("pykv:load_failures",
        "Storage blocks whose load failed (missing, corrupt); their tokens were recomputed.")
    STORE_SKIPPED = ("pykv:store_skipped",
        "Storage blocks not stored because they were already on disk or being stored.")
    STORE_FAILURES = "pykv:store_failures", "Storage blocks whose store failed (disk full, read-only tree, ...)."
    STORES_DISABLED = ("pykv:stores_disabled",
        "Storage blocks not stored because stores were paused after a store failure.")
    STORES_OFF = "pykv:stores_off", "Storage blocks not stored because this instance only loads (`store` is false)."
    GATE_REFUSALS = ("pykv:gate_refusals",
        "Lookups whose load the break-even gate refused (prefix below the tier's threshold).")
    GATE_REFUSED_TOKENS = ("pykv:gate_refused_tokens",
        "Tokens the break-even gate chose to recompute instead of loading (a request shorter than every "
        "threshold is refused before any lookup and adds none).")
    PRELOAD_REQUESTS = ("pykv:preload_requests",
        "Waiting requests whose stored blocks were sent to the workers to read ahead.")
    PRELOAD_BLOCKS = ("pykv:preload_blocks",
        "Storage blocks named in those read-ahead plans, per request (the workers read a block "
        "that several waiting requests share once).")
    STORES_OVER_LIMIT = ("pykv:stores_over_limit",
        "Storage blocks not stored because the tree stayed over max_tree_bytes after an eviction round "
        "(its blocks younger than evict_min_age).")
    EVICT_ROUNDS = ("pykv:evict_rounds",
        "Eviction rounds this engine ran under a device's lease (a scan; rounds that found the device "
        "within max_tree_bytes included).")
    EVICTED_BLOCKS = "pykv:evicted_blocks", "Storage blocks this engine's eviction rounds deleted."
    EVICTED_BYTES = "pykv:evicted_bytes", "Bytes those blocks occupied."
    EVICT_LEASE_SKIPS = ("pykv:evict_lease_skips",
        "Eviction rounds skipped because another engine held the device's eviction lease.")
    EVICT_ERRORS = "pykv:evict_errors", "Eviction rounds that failed (logged; tried again at the next check)."
    LOOKUPS_UNANSWERED = ("pykv:lookups_unanswered",
        "Existence checks a device did not answer within lookup_deadline (a stalled or overloaded mount); "
        "their blocks counted as misses and were recomputed.")
    STORES_UNANSWERED = ("pykv:stores_unanswered",
        "Storage blocks not stored because their device did not answer the existence check within "
        "lookup_deadline.")
    STORED_BLOCKS = ("pykv:stored_blocks",
        "Storage blocks whose store ended well for vLLM (published, or sealed in the DRAM tier first: a later "
        "failure of its file counts in pykv:store_failures).")


METRIC_DOCS = {metric: metric.doc for metric in Metric}

DEVICE_LABEL = "device"  # a device's index in ``roots`` ("0" with one ``root``)
ROOT_LABEL = "root"  # its directory (``pykv:device_info`` only)


class Gauge(_Documented):
    """The scheduler's gauges vLLM exports, per device of the tree (label ``device``). NaN: not known
    (yet): the tree's gauges come from this engine's eviction rounds, which need ``max_tree_bytes``."""

    DEVICE_INFO = "pykv:device_info", "1 per device; its `root` label is the device's directory."
    TREE_LIMIT_BYTES = ("pykv:tree_limit_bytes",
        "The max_tree_bytes this engine keeps the device under (0: none; no limit, or `store` false).")
    TREE_BYTES = ("pykv:tree_bytes",
        "Bytes of block files on the device after this engine's last eviction round on it (NaN until then).")
    TREE_BLOCKS = "pykv:tree_blocks", "Block files on the device after that round (NaN until then)."
    EVICT_BEHIND = ("pykv:evict_behind",
        "1 while this engine's last round left the device over the limit (stores pause), else 0.")
    EVICT_ROUND_AGE = ("pykv:evict_round_age_seconds",
        "Seconds from this engine's last completed round on the device to its latest report (NaN until the "
        "first round; reports ride on engine steps, so an idle engine shows its last value).")
    QUARANTINE_BYTES = ("pykv:quarantine_bytes",
        "Bytes of files in the device's .pykv/quarantine, counted after a round, at most once a minute (NaN "
        "until then).")
    QUARANTINE_FILES = ("pykv:quarantine_files",
        "Files in the device's .pykv/quarantine, counted with pykv:quarantine_bytes (NaN until then).")

    @property
    def labelnames(self) -> tuple[str, ...]:
        return (DEVICE_LABEL, ROOT_LABEL) if self is Gauge.DEVICE_INFO else (DEVICE_LABEL,)


def prometheus_names() -> frozenset[str]:
    """The sample names pykv puts on ``/metrics``, as PromQL names them: ``<counter>_total``, ``<gauge>``."""
    return frozenset({f"{metric}_total" for metric in Metric} | {str(gauge) for gauge in Gauge})


class SchedulerCounter(_Documented):
    """The scheduler's counter file: every ``Metric`` (by its name) plus these."""

    DRAM_ENTRIES = "dram_entries", "Blocks in the DRAM tier now (a gauge)."
    PENDING_STORES = "pending_stores", "Blocks being stored now (a gauge)."
    SURVEYS = "surveys", "Requests whose blocks were looked up at once before vLLM's lookups (``survey_request``)."
    SURVEY_US = ("survey_us",
        "Microseconds the scheduler spent in those surveys (the disk checks and the gate), summed: "
        "time in the scheduler's step before a hit's load can start.")
    GATE_US = ("gate_us",
        "Of that, microseconds the break-even gate spent deciding (with breakeven_file): what the gate "
        "itself adds to a request beside the lookups every engine makes.")
    SURVEY_BEGAN_NS = ("survey_began_ns",
        "When the latest survey began (a gauge: wall-clock nanoseconds since the epoch, comparable "
        "across the engine's processes).")
    SURVEY_ENDED_NS = "survey_ended_ns", "When it ended (a gauge, as above)."
    LOAD_PLANNED_NS = ("load_planned_ns",
        "When the scheduler last planned a load (``prepare_load`` returned; a gauge, as above).")


class WorkerCounter(_Documented):
    """A worker's counter file (``worker<rank>``)."""

    LOAD_JOBS = "load_jobs", "Load jobs vLLM submitted."
    LOAD_JOBS_EXPEDITED = "load_jobs_expedited", "Load jobs submitted as urgent (vLLM waits on them now)."
    LOAD_JOB_US = "load_job_us", "Microseconds from submit to end, summed over load jobs."
    LOAD_JOB_MAX_US = "load_job_max_us", "The longest load job, in microseconds."
    LOAD_JOB_BYTES = "load_job_bytes", "Bytes delivered by load jobs (DRAM tier and disk)."
    LOAD_BLOCKS_DISK = "load_blocks_disk", "Storage blocks loaded from the tree."
    LOAD_BLOCKS_DRAM = "load_blocks_dram", "Storage blocks loaded from the DRAM tier."
    LOAD_BLOCKS_FAILED_DISK = ("load_blocks_failed_disk",
        "Storage blocks whose load from the tree failed (recomputed).")
    LOAD_BLOCKS_FAILED_DRAM = ("load_blocks_failed_dram",
        "Storage blocks whose load from the DRAM tier failed (recomputed).")
    LOAD_BLOCKS_UNAUTHENTICATED = ("load_blocks_unauthenticated",
        "Of the failed loads from the tree, blocks refused for their MAC (auth_key_file): unsigned, "
        "an unknown key id or a wrong MAC (recomputed, quarantined).")
    DRAM_DELIVERED_BLOCKS = "dram_delivered_blocks", "Blocks copied to the GPU straight from DRAM-tier slots."
    DRAM_DELIVERED_BYTES = "dram_delivered_bytes", "Their bytes."
    STORE_JOBS = "store_jobs", "Store jobs vLLM submitted."
    LOAD_JOBS_GIVEN_UP = ("load_jobs_given_up",
        "Load jobs given up after io_deadline without progress (a stalled mount): their blocks not yet copied "
        "were recomputed.")
    STORE_JOBS_GIVEN_UP = ("store_jobs_given_up",
        "Store jobs vLLM got back after io_deadline without progress, their unfilled blocks unstored.")
    STORE_JOBS_RELEASED_EARLY = ("store_jobs_released_early",
        "Store jobs that ended for vLLM once sealed in DRAM-tier slots.")
    STORE_BLOCKS = "store_blocks", "Storage blocks in store jobs that ended."
    STORE_PUBLISHED = "store_published", "Block files published."
    STORE_BLOCKS_FAILED = "store_blocks_failed", "Storage blocks whose store failed."
    STORE_BLOCKS_PAUSED = "store_blocks_paused", "Storage blocks not written because stores were paused."
    STORE_BLOCKS_SHED = ("store_blocks_shed",
        "Storage blocks of a store dropped because vLLM needed their GPU blocks back before a staging "
        "slot was free (the disk could not keep up; the engine did not wait).")
    STORE_PAUSES = "store_pauses", "Times stores were paused after a disk failure."
    BLOCKS_UNANSWERED = ("blocks_unanswered",
        "Storage blocks of load and store jobs (several devices) a device did not answer the existence check "
        "for within lookup_deadline (a stalled mount): a load failed them, and every later block of its part, "
        "unread and recomputed (in load_blocks_failed_disk); a store left them unstored (in store_blocks_failed).")
    QUARANTINED = "quarantined", "Corrupt block files moved to quarantine."
    PRELOAD_BLOCKS_PLANNED = "preload_blocks_planned", "Blocks named in preload plans this worker received."
    FLUSH_WAITS = "flush_waits", "Times vLLM waited for store jobs (``wait``)."
    FLUSH_WAIT_US = "flush_wait_us", "Microseconds vLLM spent in those waits."
    IDLE_WAITS = ("idle_waits",
        "Engine steps that ran no model while loads ran, on which the worker waited for a load to end "
        "(``idle_wait_ms``).")
    IDLE_WAIT_US = "idle_wait_us", "Microseconds the engine's loop spent in those waits."
    JOBS_IN_FLIGHT = "jobs_in_flight", "Jobs not yet reported to vLLM (a gauge: 0 when idle)."
    LOAD_REPORT_WAIT_US = ("load_report_wait_us",
        "Microseconds from a load job's end to vLLM collecting it (``get_finished``), summed: time a "
        "request waits after its KV is in place until vLLM's next poll.")
    LOAD_SUBMITTED_NS = ("load_submitted_ns",
        "When vLLM last submitted a load job to this worker (a gauge: wall-clock nanoseconds since the "
        "epoch, comparable with the scheduler's ``*_ns``).")
    LOAD_ENDED_NS = "load_ended_ns", "When the latest load job ended (a gauge, as above)."
    LOAD_REPORTED_NS = "load_reported_ns", "When vLLM last collected an ended load job (a gauge, as above)."
    # the reactor's
    DISK_READS = "disk_reads", "Block reads started (demand and preload)."
    DISK_READ_BYTES = "disk_read_bytes", "Their bytes."
    DELIVERED_BLOCKS = "delivered_blocks", "Blocks handed to the GPU copier (from disk and from DRAM slots)."
    DELIVERED_BYTES = "delivered_bytes", "Their bytes."
    PRELOADS_SUBMITTED = "preloads_submitted", "Preload blocks submitted to the reactor."
    PRELOADS_STARTED = "preloads_started", "Preload reads started."
    PRELOADS_CLAIMED = "preloads_claimed", "Demand loads served by a preload."
    PRELOADS_JOINED = "preloads_joined", "Of those, the ones served while the preload's read was in flight."
    PRELOADS_RECLAIMED = "preloads_reclaimed", "Finished preloads whose slot a demand load took back."
    PRELOADS_FAILED = "preloads_failed", "Preload reads that failed."
    PRELOAD_WASTED_BYTES = "preload_wasted_bytes", "Bytes preloaded and never claimed."
    SLOTS_HIGH = "slots_high", "The most staging slots held at once."
    STAGING_BYTES = "staging_bytes", "Bytes of the staging pool (a gauge, set at start)."
    STAGING_HUGE_BYTES = ("staging_huge_bytes",
        "Of those, bytes on transparent huge pages once page-locked (a gauge, set at start; fewer make "
        "each O_DIRECT read pin more pages).")
    PRELOAD_SLOTS_HIGH = "preload_slots_high", "The most staging slots preloads held at once."
    # the GPU copier's
    H2D_BATCHES = "h2d_batches", "Host-to-GPU copy batches (loads)."
    H2D_ENTRIES = "h2d_entries", "Copy entries in those batches."
    H2D_ISSUE_US = "h2d_issue_us", "Host microseconds spent issuing them."
    H2D_BUILD_US = "h2d_build_us", "Of the issuing, microseconds building the batched op's pointer lists."
    H2D_OP_US = ("h2d_op_us",
        "Of the issuing, microseconds in the batched op's call (it releases the GIL: taking it back "
        "counts here).")
    H2D_QUEUED_US = "h2d_queued_us", "Microseconds batches waited for the copier's load thread."
    H2D_GPU_US = "h2d_gpu_us", "GPU microseconds they took (CUDA events)."
    H2D_WALL_US = "h2d_wall_us", "Wall microseconds from issue to completion."
    # a codec on the KV's device (``device_codec``), CUDA only
    CODEC_STEPS = "codec_steps", "Device codec steps issued (a store, or several loads of one length)."
    CODEC_LOADS = "codec_loads", "Loads in those steps (loads per step: this over the load steps)."
    CODEC_LOAD_STEPS = "codec_load_steps", "Of the steps, load steps."
    CODEC_QUEUED_US = "codec_queued_us", "Microseconds works waited in the codec's queue, summed over works."
    CODEC_ISSUE_US = "codec_issue_us", "Host microseconds the issuing thread spent issuing steps."
    CODEC_FRAMES_US = ("codec_frames_us",
        "Of the issuing, microseconds in the GPU frame decoder's calls (planes-zstd: nvCOMP).")
    CODEC_GRAPH_STEPS = ("codec_graph_steps",
        "Of the load steps, those replayed as one CUDA graph (``codec_graphs``).")
    CODEC_GRAPHS = "codec_graphs", "Step shapes captured as CUDA graphs (a gauge)."
    CODEC_GPU_US = "codec_gpu_us", "GPU microseconds between each step's first and last event (CUDA events)."
    CODEC_WALL_US = "codec_wall_us", "Wall microseconds from each step's issue to the poller seeing its end."


WORKER_COUNTER_DOCS = {counter: counter.doc for counter in WorkerCounter}


class CounterFile:
    """Writes one process's counters for ``role`` ("scheduler", "worker0", ...) when
    ``PYKV_STATS_FILE`` is set; a no-op otherwise.

    ``write`` only takes a snapshot: a writer thread (started on the first change) replaces
    the file, so the engine's step never waits on a create and a rename (~0.15 ms each on
    ext4). Snapshots that arrive while it writes are coalesced: the file gets the latest.
    ``flush`` waits until it is written; at interpreter exit the last one is written too."""

    def __init__(self, role: str, *, base: str | None = None) -> None:
        base = base if base is not None else os.environ.get(ENV)
        self.path = f"{base}.{role}.json" if base else None
        self._last: dict | None = None
        self._pending: dict | None = None
        self._writing = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._failed = False

    @property
    def enabled(self) -> bool:
        """Whether counters are written at all (callers skip gathering them otherwise)."""
        return self.path is not None

    def write(self, counters: Mapping[str, int]) -> None:
        """Have the file replaced by these counters soon (nothing happens when they did not change)."""
        if self.path is None:
            return
        snapshot = {str(name): int(value) for name, value in counters.items()}
        with self._changed:
            if snapshot == self._last:
                return
            self._last = self._pending = snapshot
            if self._thread is None or self._pid != os.getpid():  # none yet, or forked without it
                self._writing = False
                if not self._start_writer():
                    self._pending = None
                    self._write_now(snapshot)  # interpreter shutting down: no new thread
                    return
            self._changed.notify_all()

    def _start_writer(self) -> bool:
        thread = threading.Thread(target=self._run, name=f"pykv-counters-{self.path}", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            return False
        self._pid, self._thread = os.getpid(), thread
        atexit.register(self.flush)
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout`` seconds) until the last snapshot is in the file; whether it is."""
        with self._changed:
            return self._changed.wait_for(lambda: self._pending is None and not self._writing, timeout)

    def _write_now(self, snapshot: dict) -> None:
        try:
            write_atomically(self.path, json.dumps(snapshot, sort_keys=True), durable=False)
        except OSError as exc:
            if not self._failed:  # once: the counters are a diagnostic, serving goes on
                self._failed = True
                log.warning("pykv: cannot write counter file %s (%s)", self.path, exc.strerror or exc)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None)
                snapshot, self._pending, self._writing = self._pending, None, True
            self._write_now(snapshot)
            with self._changed:
                self._writing = False
                self._changed.notify_all()


@dataclass(frozen=True)
class CounterSnapshot:
    """Every counter file under one ``PYKV_STATS_FILE`` base, by role."""

    roles: dict[str, dict[str, int]] = field(default_factory=dict)

    def scheduler(self) -> dict[str, int]:
        return self.roles.get("scheduler", {})

    def worker(self, rank: int = 0) -> dict[str, int]:
        return self.roles.get(f"worker{rank}", {})

    def workers(self) -> list[dict[str, int]]:
        return [c for role, c in sorted(self.roles.items()) if role.startswith("worker")]

    @property
    def busy(self) -> bool:
        """Whether any worker still has jobs vLLM has not been told about."""
        return any(w.get(WorkerCounter.JOBS_IN_FLIGHT, 0) for w in self.workers())


def read_counters(base: str | Path) -> CounterSnapshot:
    """The counter files written under ``base`` (skipping any that are not a counter file)."""
    base = Path(base)
    roles: dict[str, dict[str, int]] = {}
    try:
        candidates = sorted(base.parent.glob(base.name + ".*.json"))
    except OSError:
        return CounterSnapshot()
    for path in candidates:
        counters = _read_one(path)
        if counters is not None:
            roles[path.name[len(base.name) + 1:-len(".json")]] = counters
    return CounterSnapshot(roles)


def _read_one(path: Path) -> dict[str, int] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, MAX_FILE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        return None
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    return {str(k): v for k, v in parsed.items() if isinstance(v, int) and not isinstance(v, bool)}
