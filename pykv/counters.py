"""pykv's counters: their names, what each means, and the counter files that carry them out.

Two kinds of counters:

- ``Metric``: the scheduler's counters that vLLM exports (``get_stats``, Prometheus
  ``/metrics``), documented in ``METRIC_DOCS``.
- ``WorkerCounter`` and ``SchedulerCounter``: each process's own counters, written to a
  counter file when ``PYKV_STATS_FILE`` is set. vLLM has no channel for worker-side
  counters and in its default multiprocess mode neither side runs in the caller's
  process, so the jobs that drive engines (calibrate, warm, demo, the end-to-end tests)
  read these files.

A counter file is ``$PYKV_STATS_FILE.<role>.json`` (roles ``scheduler``, ``worker0``,
``worker1``, ...), one JSON object of name to integer, replaced atomically whenever the
process's counters change. ``read_counters`` reads them back bounded and tolerant: a
file that is missing, half written, oversized or not an object of integers is skipped.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from pykv.io.atomic import write_atomically

ENV = "PYKV_STATS_FILE"
MAX_FILE_BYTES = 1 << 20  # a counter file is a few KiB; anything larger is not one


class Metric(enum.StrEnum):
    """The scheduler counters vLLM exports (names as they appear in ``/metrics``)."""

    HITS_DRAM = "pykv:load_hits_dram"
    HITS_DISK = "pykv:load_hits_disk"
    LOAD_FAILURES = "pykv:load_failures"
    STORE_SKIPPED = "pykv:store_skipped"
    STORE_FAILURES = "pykv:store_failures"
    STORES_DISABLED = "pykv:stores_disabled"
    STORES_OFF = "pykv:stores_off"
    GATE_REFUSALS = "pykv:gate_refusals"
    GATE_REFUSED_TOKENS = "pykv:gate_refused_tokens"
    PRELOAD_REQUESTS = "pykv:preload_requests"
    PRELOAD_BLOCKS = "pykv:preload_blocks"


METRIC_DOCS = {
    Metric.HITS_DRAM: "Storage blocks loaded from pykv's DRAM tier (no disk read).",
    Metric.HITS_DISK: "Storage blocks loaded from the pykv file tree.",
    Metric.LOAD_FAILURES: "Storage blocks whose load failed (missing, corrupt); their tokens were recomputed.",
    Metric.STORE_SKIPPED: "Storage blocks not stored because they were already on disk or being stored.",
    Metric.STORE_FAILURES: "Storage blocks whose store failed (disk full, read-only tree, ...).",
    Metric.STORES_DISABLED: "Storage blocks not stored because stores were paused after a store failure.",
    Metric.STORES_OFF: "Storage blocks not stored because this instance only loads (`store` is false).",
    Metric.GATE_REFUSALS: "Lookups whose load the break-even gate refused (prefix below the tier's threshold).",
    Metric.GATE_REFUSED_TOKENS: "Tokens the break-even gate chose to recompute instead of loading.",
    Metric.PRELOAD_REQUESTS: "Waiting requests whose stored blocks were sent to the workers to read ahead.",
    Metric.PRELOAD_BLOCKS: "Storage blocks named in those read-ahead plans, per request (the workers read "
                           "a block that several waiting requests share once).",
}


class SchedulerCounter(enum.StrEnum):
    """The scheduler's counter file: every ``Metric`` (by its name) plus these."""

    DRAM_ENTRIES = "dram_entries"
    PENDING_STORES = "pending_stores"


class WorkerCounter(enum.StrEnum):
    """A worker's counter file (``worker<rank>``)."""

    LOAD_JOBS = "load_jobs"
    LOAD_JOBS_EXPEDITED = "load_jobs_expedited"
    LOAD_JOB_US = "load_job_us"
    LOAD_JOB_MAX_US = "load_job_max_us"
    LOAD_JOB_BYTES = "load_job_bytes"
    LOAD_BLOCKS_DISK = "load_blocks_disk"
    LOAD_BLOCKS_DRAM = "load_blocks_dram"
    LOAD_BLOCKS_FAILED_DISK = "load_blocks_failed_disk"
    LOAD_BLOCKS_FAILED_DRAM = "load_blocks_failed_dram"
    DRAM_DELIVERED_BLOCKS = "dram_delivered_blocks"
    DRAM_DELIVERED_BYTES = "dram_delivered_bytes"
    STORE_JOBS = "store_jobs"
    STORE_JOBS_RELEASED_EARLY = "store_jobs_released_early"
    STORE_BLOCKS = "store_blocks"
    STORE_PUBLISHED = "store_published"
    STORE_BLOCKS_FAILED = "store_blocks_failed"
    STORE_BLOCKS_PAUSED = "store_blocks_paused"
    STORE_PAUSES = "store_pauses"
    QUARANTINED = "quarantined"
    PRELOAD_BLOCKS_PLANNED = "preload_blocks_planned"
    FLUSH_WAITS = "flush_waits"
    FLUSH_WAIT_US = "flush_wait_us"
    JOBS_IN_FLIGHT = "jobs_in_flight"
    # the reactor's
    DISK_READS = "disk_reads"
    DISK_READ_BYTES = "disk_read_bytes"
    DELIVERED_BLOCKS = "delivered_blocks"
    DELIVERED_BYTES = "delivered_bytes"
    PRELOADS_SUBMITTED = "preloads_submitted"
    PRELOADS_STARTED = "preloads_started"
    PRELOADS_CLAIMED = "preloads_claimed"
    PRELOADS_JOINED = "preloads_joined"
    PRELOADS_RECLAIMED = "preloads_reclaimed"
    PRELOADS_FAILED = "preloads_failed"
    PRELOAD_WASTED_BYTES = "preload_wasted_bytes"
    SLOTS_HIGH = "slots_high"
    PRELOAD_SLOTS_HIGH = "preload_slots_high"
    # the GPU copier's
    H2D_BATCHES = "h2d_batches"
    H2D_ENTRIES = "h2d_entries"
    H2D_ISSUE_US = "h2d_issue_us"
    H2D_GPU_US = "h2d_gpu_us"
    H2D_WALL_US = "h2d_wall_us"


WORKER_COUNTER_DOCS = {
    WorkerCounter.LOAD_JOBS: "Load jobs vLLM submitted.",
    WorkerCounter.LOAD_JOBS_EXPEDITED: "Load jobs submitted as urgent (vLLM waits on them now).",
    WorkerCounter.LOAD_JOB_US: "Microseconds from submit to end, summed over load jobs.",
    WorkerCounter.LOAD_JOB_MAX_US: "The longest load job, in microseconds.",
    WorkerCounter.LOAD_JOB_BYTES: "Bytes delivered by load jobs (DRAM tier and disk).",
    WorkerCounter.LOAD_BLOCKS_DISK: "Storage blocks loaded from the tree.",
    WorkerCounter.LOAD_BLOCKS_DRAM: "Storage blocks loaded from the DRAM tier.",
    WorkerCounter.LOAD_BLOCKS_FAILED_DISK: "Storage blocks whose load from the tree failed (recomputed).",
    WorkerCounter.LOAD_BLOCKS_FAILED_DRAM: "Storage blocks whose load from the DRAM tier failed (recomputed).",
    WorkerCounter.DRAM_DELIVERED_BLOCKS: "Blocks copied to the GPU straight from DRAM-tier slots.",
    WorkerCounter.DRAM_DELIVERED_BYTES: "Their bytes.",
    WorkerCounter.STORE_JOBS: "Store jobs vLLM submitted.",
    WorkerCounter.STORE_JOBS_RELEASED_EARLY: "Store jobs that ended for vLLM once sealed in DRAM-tier slots.",
    WorkerCounter.STORE_BLOCKS: "Storage blocks in store jobs that ended.",
    WorkerCounter.STORE_PUBLISHED: "Block files published.",
    WorkerCounter.STORE_BLOCKS_FAILED: "Storage blocks whose store failed.",
    WorkerCounter.STORE_BLOCKS_PAUSED: "Storage blocks not written because stores were paused.",
    WorkerCounter.STORE_PAUSES: "Times stores were paused after a disk failure.",
    WorkerCounter.QUARANTINED: "Corrupt block files moved to quarantine.",
    WorkerCounter.PRELOAD_BLOCKS_PLANNED: "Blocks named in preload plans this worker received.",
    WorkerCounter.FLUSH_WAITS: "Times vLLM waited for store jobs (``wait``).",
    WorkerCounter.FLUSH_WAIT_US: "Microseconds vLLM spent in those waits.",
    WorkerCounter.JOBS_IN_FLIGHT: "Jobs not yet reported to vLLM (a gauge: 0 when idle).",
    WorkerCounter.DISK_READS: "Block reads started (demand and preload).",
    WorkerCounter.DISK_READ_BYTES: "Their bytes.",
    WorkerCounter.DELIVERED_BLOCKS: "Blocks handed to the GPU copier (from disk and from DRAM slots).",
    WorkerCounter.DELIVERED_BYTES: "Their bytes.",
    WorkerCounter.PRELOADS_SUBMITTED: "Preload blocks submitted to the reactor.",
    WorkerCounter.PRELOADS_STARTED: "Preload reads started.",
    WorkerCounter.PRELOADS_CLAIMED: "Demand loads served by a preload.",
    WorkerCounter.PRELOADS_JOINED: "Of those, the ones served while the preload's read was in flight.",
    WorkerCounter.PRELOADS_RECLAIMED: "Finished preloads whose slot a demand load took back.",
    WorkerCounter.PRELOADS_FAILED: "Preload reads that failed.",
    WorkerCounter.PRELOAD_WASTED_BYTES: "Bytes preloaded and never claimed.",
    WorkerCounter.SLOTS_HIGH: "The most staging slots held at once.",
    WorkerCounter.PRELOAD_SLOTS_HIGH: "The most staging slots preloads held at once.",
    WorkerCounter.H2D_BATCHES: "Host-to-GPU copy batches (loads).",
    WorkerCounter.H2D_ENTRIES: "Copy entries in those batches.",
    WorkerCounter.H2D_ISSUE_US: "Host microseconds spent issuing them.",
    WorkerCounter.H2D_GPU_US: "GPU microseconds they took (CUDA events).",
    WorkerCounter.H2D_WALL_US: "Wall microseconds from issue to completion.",
}


class CounterFile:
    """Writes one process's counters for ``role`` ("scheduler", "worker0", ...) when
    ``PYKV_STATS_FILE`` is set; a no-op otherwise."""

    def __init__(self, role: str, *, base: str | None = None) -> None:
        base = base if base is not None else os.environ.get(ENV)
        self.path = f"{base}.{role}.json" if base else None
        self._last: dict | None = None

    @property
    def enabled(self) -> bool:
        """Whether counters are written at all (callers skip gathering them otherwise)."""
        return self.path is not None

    def write(self, counters: Mapping[str, int]) -> None:
        if self.path is None:
            return
        snapshot = {str(name): int(value) for name, value in counters.items()}
        if snapshot == self._last:
            return
        self._last = snapshot
        write_atomically(self.path, json.dumps(snapshot, sort_keys=True), durable=False)


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
