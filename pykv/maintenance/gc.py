"""Garbage collection: delete least-recently-accessed blocks until the tree fits.

``plan_gc`` is pure: given scanned entries, a size limit, a minimum age and a
clock, it says how much must go and in which order. ``collect`` carries a plan
out against the live tree, which vLLM instances may be reading and writing:

* each candidate is re-stat'ed right before deletion. A newer atime than the
  plan saw (``KVTree.touch`` ran since the scan, or the catalog's atime was
  stale) puts it back in the queue under its new atime, so the order stays
  exactly least-recently-accessed first; a newer mtime (re-published) makes it
  young again and it is kept;
* a file that is already gone was freed by someone else: it counts against the
  bytes still to free, never as an error. Readers see a deleted block as a miss.

The tree's size is the sum of ``st_size`` over block files; temp and foreign
files are fsck's business. A block younger than ``min_age`` (by mtime, its
publication time) is never deleted, even when that leaves the tree too big.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import stat
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any, Iterable

from pykv.maintenance.catalog import scan_tree
from pykv.maintenance.scan import Entry, Kind, collector_paused
from pykv.tree import KVTree

log = logging.getLogger(__name__)

GC_STATE_NAME = "gc.json"
DEFAULT_MIN_AGE_S = 600.0


@dataclass(frozen=True)
class GcPlan:
    """What a gc must do. ``candidates`` are old-enough blocks, least recently accessed first."""

    max_size: int
    min_mtime_ns: int  # blocks published after this are too young to delete
    total_bytes: int
    total_files: int
    candidates: list[Entry]
    young_files: int
    young_bytes: int

    @property
    def to_free(self) -> int:
        return max(0, self.total_bytes - self.max_size)

    def victims(self) -> list[Entry]:
        """The candidates the plan would delete, judged by the scanned atimes alone."""
        chosen, freed = [], 0
        for entry in self.candidates:
            if freed >= self.to_free:
                break
            chosen.append(entry)
            freed += entry.size
        return chosen


def plan_gc(entries: Iterable[Entry], max_size: int, *, min_age_s: float = DEFAULT_MIN_AGE_S,
            now_ns: int | None = None) -> GcPlan:
    """Plan a gc of ``entries`` (non-blocks are ignored) down to ``max_size`` bytes."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    min_mtime_ns = now_ns - int(min_age_s * 1e9)
    total_bytes = total_files = young_files = young_bytes = 0
    candidates = []
    for entry in entries:
        if entry.kind is not Kind.BLOCK:
            continue
        total_bytes += entry.size
        total_files += 1
        if entry.mtime_ns > min_mtime_ns:
            young_files += 1
            young_bytes += entry.size
        else:
            candidates.append(entry)
    candidates.sort(key=attrgetter("atime_ns"))
    return GcPlan(max_size, min_mtime_ns, total_bytes, total_files, candidates, young_files, young_bytes)


@dataclass
class GcResult:
    """What a gc did (or, with ``dry_run``, would do)."""

    max_size: int
    total_bytes: int
    total_files: int
    dry_run: bool
    freed_bytes: int = 0
    freed_files: int = 0
    vanished_bytes: int = 0  # deleted by someone else between scan and delete
    vanished_files: int = 0
    young_files: int = 0
    young_bytes: int = 0
    freed_by_namespace: Counter = field(default_factory=Counter)
    deleted: list[Entry] = field(default_factory=list, repr=False)
    finished_at: float = 0.0
    seconds: float = 0.0

    @property
    def remaining_bytes(self) -> int:
        return self.total_bytes - self.freed_bytes - self.vanished_bytes

    @property
    def target_reached(self) -> bool:
        return self.remaining_bytes <= self.max_size

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (what ``gc.json`` and ``pykv gc --json`` hold)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("deleted", "freed_by_namespace")}
        data["remaining_bytes"] = self.remaining_bytes
        data["target_reached"] = self.target_reached
        data["freed_by_namespace"] = dict(self.freed_by_namespace)
        return data


def collect(plan: GcPlan, *, dry_run: bool = False) -> GcResult:
    """Delete the plan's blocks, oldest access first, re-checking each just before."""
    result = GcResult(plan.max_size, plan.total_bytes, plan.total_files, dry_run,
                      young_files=plan.young_files, young_bytes=plan.young_bytes)
    candidates = plan.candidates
    heap = [(entry.atime_ns, i) for i, entry in enumerate(candidates)]  # sorted, hence a heap
    heapq.heapify(heap)
    needed = plan.to_free
    while result.freed_bytes < needed and heap:
        atime_ns, i = heapq.heappop(heap)
        entry = candidates[i]
        try:
            st = os.lstat(entry.path)
        except FileNotFoundError:
            needed -= entry.size
            result.vanished_files += 1
            result.vanished_bytes += entry.size
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_mtime_ns > plan.min_mtime_ns:
            continue  # replaced since the scan: not the block the plan saw
        if st.st_atime_ns > atime_ns:
            heapq.heappush(heap, (st.st_atime_ns, i))
            continue
        if not dry_run:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                needed -= entry.size
                result.vanished_files += 1
                result.vanished_bytes += entry.size
                continue
        result.freed_bytes += st.st_size
        result.freed_files += 1
        result.freed_by_namespace[entry.namespace] += st.st_size
        result.deleted.append(entry)
    return result


def run_gc(tree: KVTree, max_size: int, *, min_age_s: float = DEFAULT_MIN_AGE_S, dry_run: bool = False,
           use_catalog: bool = True) -> GcResult:
    """Scan, plan and collect; record the outcome in ``gc.json`` unless ``dry_run``."""
    started = time.monotonic()
    scan = scan_tree(tree, use_catalog=use_catalog)
    with collector_paused():
        result = collect(plan_gc(scan.entries, max_size, min_age_s=min_age_s), dry_run=dry_run)
    result.finished_at = time.time()
    result.seconds = time.monotonic() - started
    if not dry_run:
        try:
            record_gc(tree, result)
        except OSError as exc:  # a read-only .pykv must not turn a done gc into a failure
            log.warning("could not record gc in %s: %s", tree.state_dir / GC_STATE_NAME, exc)
    return result


def record_gc(tree: KVTree, result: GcResult) -> None:
    """Write ``<root>/.pykv/gc.json`` atomically (temp file, then rename over)."""
    final = tree.ensure_state_dir() / GC_STATE_NAME
    temp = tree.temp_path(final)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, tree.options.file_mode)
    try:
        os.write(fd, json.dumps(result.summary(), indent=2).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, final)


def last_gc(tree: KVTree) -> dict[str, Any] | None:
    """The summary of the last gc recorded in ``gc.json``; None if none (or unreadable)."""
    try:
        data = json.loads((tree.state_dir / GC_STATE_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
