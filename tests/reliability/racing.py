"""Processes released together by one barrier, each sending one report through a queue: races
between processes (no shared GIL), or between a network file system's clients."""

from __future__ import annotations

import multiprocessing
import traceback
from typing import Any, Callable, Sequence

from pykv.tree import KVTree


def race(target: Callable[..., None], args_per_process: Sequence[tuple], *, method: str = "spawn",
         timeout: float = 120) -> tuple[list[Any], list[int | None]]:
    """Run ``target(*args, start, results)`` in one process per ``args``, all released by the
    barrier ``start``; each puts one report on ``results``. Returns (the reports, in arrival
    order; the processes' exit codes)."""
    ctx = multiprocessing.get_context(method)
    start, results = ctx.Barrier(len(args_per_process)), ctx.Queue()
    processes = [ctx.Process(target=target, args=(*args, start, results)) for args in args_per_process]
    for process in processes:
        process.start()
    try:
        reports = [results.get(timeout=timeout) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=60)
    return reports, [process.exitcode for process in processes]


def contend_for_lease(root: str, holder: str, start, results) -> None:
    """One engine: try to take the tree's eviction lease once and keep it (no release); report
    (holder, won, "" or the traceback)."""
    try:
        from pykv.maintenance.lease import Lease
        lease = Lease(KVTree.open(root), holder, ttl_s=30)
        start.wait(timeout=60)
        results.put((holder, lease.acquire(), ""))
    except Exception:  # noqa: BLE001
        results.put((holder, False, traceback.format_exc()))
