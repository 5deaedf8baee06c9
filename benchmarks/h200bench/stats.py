"""The engines' counters, read from pykv's counter files (``pykv.counters``).

pykv's load bandwidth is the bytes and seconds of the request's load jobs (submission to the
reactor until the last byte is on the GPU), which the worker counts itself
(``WorkerCounter.LOAD_JOB_BYTES``, ``LOAD_JOB_US``). Runs 1-7 counted them in a benchmark
subclass of the worker under ``bench_load_*`` names; ``load_job_fields`` reads both.
"""

from __future__ import annotations

from pykv.counters import SchedulerCounter, WorkerCounter, read_counters

LOAD_JOBS = (WorkerCounter.LOAD_JOBS, "bench_load_jobs")
LOAD_BYTES = (WorkerCounter.LOAD_JOB_BYTES, "bench_load_bytes")
LOAD_US = (WorkerCounter.LOAD_JOB_US, "bench_load_us")

RECORDED = (WorkerCounter.LOAD_BLOCKS_DISK, WorkerCounter.LOAD_BLOCKS_DRAM, WorkerCounter.LOAD_BLOCKS_FAILED_DISK,
            WorkerCounter.LOAD_BLOCKS_FAILED_DRAM, WorkerCounter.STORE_BLOCKS, WorkerCounter.STORE_PUBLISHED,
            WorkerCounter.LOAD_JOBS, WorkerCounter.LOAD_JOB_BYTES, WorkerCounter.LOAD_JOB_US)
"""Worker counter deltas every TTFT record carries as top-level fields."""


def read_stats(base: str | None) -> dict[str, dict[str, int]]:
    """Every counter file under ``base`` (``PYKV_STATS_FILE``), by role; ``{}`` without a base."""
    return dict(read_counters(base).roles) if base else {}


def worker_counters(stats: dict) -> dict[str, int]:
    """Sum of the worker ranks' counters."""
    total: dict[str, int] = {}
    for role, counters in stats.items():
        if role.startswith("worker"):
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
    return total


PER_RANK = (WorkerCounter.LOAD_BLOCKS_DISK, WorkerCounter.LOAD_BLOCKS_DRAM, WorkerCounter.LOAD_BLOCKS_FAILED_DISK,
            WorkerCounter.STORE_PUBLISHED)
"""Worker counters a record keeps per rank when an engine has more than one worker (TP > 1)."""


def rank_deltas(before: dict, after: dict) -> dict[str, dict[str, int]]:
    """``PER_RANK`` deltas of each worker role (``worker0``, ``worker1``, ...) between two snapshots."""
    roles = sorted(role for role in set(before) | set(after) if role.startswith("worker"))
    return {role: {str(k): after.get(role, {}).get(k, 0) - before.get(role, {}).get(k, 0) for k in PER_RANK}
            for role in roles}


def busy(stats: dict) -> bool:
    """Whether pykv still has a transfer in flight (a worker job or a pending store)."""
    return any(c.get(WorkerCounter.JOBS_IN_FLIGHT, 0) for role, c in stats.items() if role.startswith("worker")) \
        or bool(stats.get("scheduler", {}).get(SchedulerCounter.PENDING_STORES, 0))


def counter_delta(before: dict, after: dict) -> dict:
    """Numeric counters that changed between two snapshots, as differences."""
    return {k: after[k] - before.get(k, 0) for k in sorted(after)
            if isinstance(after[k], (int, float)) and after[k] != before.get(k, 0)}


def load_job_fields(record: dict) -> tuple[int, int, int]:
    """(jobs, bytes, microseconds) of a record's load jobs, under today's names or runs 1-7's."""

    def first(names: tuple[str, ...]) -> int:
        return next((int(record[name]) for name in names if record.get(name)), 0)

    return first(LOAD_JOBS), first(LOAD_BYTES), first(LOAD_US)


def load_gb_per_s(record: dict) -> float | None:
    """pykv's load bandwidth of a TTFT record: as recorded, else from its load-job counters."""
    if record.get("load_gb_per_s") is not None:
        return record["load_gb_per_s"]
    _, nbytes, us = load_job_fields(record)
    return round(nbytes / (us / 1e6) / 1e9, 3) if us > 0 else None
