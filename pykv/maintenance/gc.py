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

The tree's size is the sum of allocated bytes over block files
(``scan.allocated_size``: a sparse file claiming a terabyte counts for what it holds);
temp and foreign files are fsck's business. A block younger than ``min_age`` (by
mtime, its publication time; times from the future are clamped, ``scan.clamp_times``)
is never deleted, even when that leaves the tree too big.

gc deletes only what pykv created: before a candidate is unlinked (relative to the
root's fd, ``pykv.io.safe_paths``) its header is read (``O_NOATIME``) and must be a
valid block header whose length is the file's size, and the file must have no other
link. Anything else at a block's name is *junk*: left in place, counted and reported
(``pykv fsck`` says what it is), never a reason to delete real blocks.

``run_gc_devices`` is gc over a device set, what ``pykv gc`` runs for one root or several.
The limit is the set's total: the blocks of all devices are planned and collected in one
least-recently-accessed order (each device scanned through its own catalog, each unlink
relative to its own root's fd), and every device records the run in its ``gc.json``. Blocks
the set cannot reach (``pykv.maintenance.placement``) get no special treatment. A set of one
is its tree's gc, ``run_gc``: the same result and ``gc.json``, with no per-device list.
``run_gc`` and ``collect_scanned`` are the one-tree steps (the engine's evictor keeps each
device under its own limit with ``collect_scanned``).
"""

from __future__ import annotations

import errno
import heapq
import json
import logging
import os
import stat
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path
from typing import Any, Iterable

from pykv.blockfile import check_block
from pykv.deviceset import DeviceSet
from pykv.errors import FormatError, InputError, UnsafePathError
from pykv.io.safe_paths import directory_fd, read_small, relative_to, unlink_beneath
from pykv.io.small_files import replace_small
from pykv.maintenance.catalog import scan_tree
from pykv.maintenance.placement import device_shares
from pykv.maintenance.scan import Entry, Kind, allocated_size, clamp_times, collector_paused
from pykv.tree import GC_STATE_NAME, STATE_DIR, KVTree
from pykv.units import MAX_DURATION_S, MAX_SIZE

log = logging.getLogger(__name__)
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
    check_limits(max_size, min_age_s)
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


def check_limits(max_size: int, min_age_s: float) -> None:
    """``InputError`` unless ``max_size`` and ``min_age_s`` are usable (checked before anything
    is scanned or created)."""
    if type(max_size) is not int or not 0 <= max_size <= MAX_SIZE:
        raise InputError(f"max_size: must be an integer between 0 and {MAX_SIZE}")
    if not isinstance(min_age_s, (int, float)) or not 0 <= min_age_s <= MAX_DURATION_S:
        raise InputError(f"min_age: must be between 0 and {MAX_DURATION_S:.0f} seconds")


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
    junk_files: int = 0  # at a block's name but not a block pykv wrote: left for fsck
    junk_bytes: int = 0
    undeleted_files: int = 0  # blocks the file system would not let go (read-only, a planted link above)
    undeleted_bytes: int = 0
    freed_by_namespace: Counter = field(default_factory=Counter)
    deleted: list[Entry] = field(default_factory=list, repr=False)
    devices: list[dict[str, Any]] = field(default_factory=list)  # per device, over a set of two or more
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
        data = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("deleted", "freed_by_namespace", "devices")}
        data["remaining_bytes"] = self.remaining_bytes
        data["target_reached"] = self.target_reached
        data["freed_by_namespace"] = dict(self.freed_by_namespace)
        if self.devices:
            data["devices"] = self.devices
        return data


def collect(plan: GcPlan, *, dry_run: bool = False, root: str | os.PathLike[str] | None = None,
            devices: DeviceSet | None = None) -> GcResult:
    """Delete the plan's blocks, oldest access first, re-checking each just before (see the
    module's docstring); with ``root``, every unlink is relative to the root's fd; with
    ``devices``, relative to the fd of the root of the device the block lies on."""
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
        now_atime, now_mtime = clamp_times(st, time.time_ns())
        if stat.S_ISREG(st.st_mode) and now_mtime > plan.min_mtime_ns:
            continue  # replaced since the scan: not the block the plan saw
        if stat.S_ISREG(st.st_mode) and now_atime > atime_ns:
            heapq.heappush(heap, (now_atime, i))
            continue
        size = allocated_size(st)
        if not _is_pykv_block(entry.path, st):
            result.junk_files += 1
            result.junk_bytes += size
            continue
        if not dry_run:
            try:
                base = root if devices is None else devices.roots[devices.device_of(entry.path)]
                if base is None:
                    os.unlink(entry.path)
                else:
                    unlink_beneath(base, relative_to(base, entry.path))
            except FileNotFoundError:
                needed -= entry.size
                result.vanished_files += 1
                result.vanished_bytes += entry.size
                continue
            except OSError as exc:  # a planted link above it, a read-only tree: not ours to force
                log.warning("gc: cannot delete %s: %s", entry.path, exc.strerror)
                result.undeleted_files += 1
                result.undeleted_bytes += size
                continue
        result.freed_bytes += size
        result.freed_files += 1
        result.freed_by_namespace[entry.namespace] += size
        result.deleted.append(entry)
    return result


def _is_pykv_block(path: str, st: os.stat_result) -> bool:
    """Whether the file at ``path`` is a block pykv wrote: a regular file with one link whose
    header is valid and whose length is the file's size (one header read, atime unchanged)."""
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return False
    try:
        return check_block(Path(path), full=False).size == st.st_size
    except (FormatError, OSError):
        return False


def run_gc(tree: KVTree, max_size: int, *, min_age_s: float = DEFAULT_MIN_AGE_S, dry_run: bool = False,
           use_catalog: bool = True) -> GcResult:
    """One tree's gc (``run_gc_devices``'s step for a set of one): scan, plan and collect; record
    the outcome in ``gc.json`` unless ``dry_run``."""
    check_limits(max_size, min_age_s)  # before the scan creates .pykv/catalog.db
    started = time.monotonic()
    scan = scan_tree(tree, use_catalog=use_catalog)
    return collect_scanned(tree, scan.entries, max_size, min_age_s=min_age_s, dry_run=dry_run, started=started)


def collect_scanned(tree: KVTree, entries: Iterable[Entry], max_size: int, *, min_age_s: float = DEFAULT_MIN_AGE_S,
                    dry_run: bool = False, started: float | None = None) -> GcResult:
    """Plan and collect ``entries`` (a scan of ``tree``) down to ``max_size``; record the outcome in
    ``gc.json`` unless ``dry_run``. ``started``: the ``time.monotonic()`` the scan began at."""
    started = time.monotonic() if started is None else started
    with collector_paused():
        result = collect(plan_gc(entries, max_size, min_age_s=min_age_s), dry_run=dry_run, root=tree.root)
    result.finished_at = time.time()
    result.seconds = time.monotonic() - started
    if not dry_run:
        _record_on([tree], result)
    return result


def run_gc_devices(devices: DeviceSet, max_size: int, *, min_age_s: float = DEFAULT_MIN_AGE_S,
                   dry_run: bool = False, use_catalog: bool = True) -> GcResult:
    """gc over a device set: ``max_size`` bounds the set's total, and the blocks of all devices go
    in one least-recently-accessed order (each device scanned through its own catalog). Every
    device records the set's outcome in its ``gc.json``. Over two or more devices, ``devices`` of
    the result says per device what it held and what was freed there; a set of one is its
    tree's ``run_gc``, result and ``gc.json`` alike."""
    if len(devices) == 1:
        return run_gc(devices[0], max_size, min_age_s=min_age_s, dry_run=dry_run, use_catalog=use_catalog)
    check_limits(max_size, min_age_s)
    started = time.monotonic()
    scans = [scan_tree(tree, use_catalog=use_catalog) for tree in devices]
    with collector_paused():
        result = collect(plan_gc([entry for scan in scans for entry in scan.entries], max_size, min_age_s=min_age_s),
                         dry_run=dry_run, devices=devices)
    result.finished_at = time.time()
    result.seconds = time.monotonic() - started
    freed = [[0, 0] for _ in range(len(devices))]
    for entry in result.deleted:
        index = devices.device_of(entry.path)
        freed[index][0] += 1
        freed[index][1] += entry.size
    result.devices = [{**share.as_dict(), "freed_files": files, "freed_bytes": size}
                      for share, (files, size) in zip(device_shares(devices, [s.entries for s in scans]), freed)]
    if not dry_run:
        _record_on(devices, result)
    return result


def _record_on(trees: Iterable[KVTree], result: GcResult) -> None:
    """``record_gc`` on each tree; a failure is logged (a read-only .pykv must not turn a done gc
    into a failure)."""
    for tree in trees:
        try:
            record_gc(tree, result)
        except OSError as exc:
            log.warning("could not record gc in %s: %s", tree.state_dir / GC_STATE_NAME, exc)


def record_gc(tree: KVTree, result: GcResult) -> None:
    """Write ``<root>/.pykv/gc.json`` atomically (temp file, then rename over), relative to the
    state dir's fd; the temp is removed again when either step fails (a full disk)."""
    content = json.dumps(result.summary(), indent=2).encode()
    with directory_fd(tree.root, STATE_DIR, create_mode=tree.options.dir_mode) as fd:
        _refuse_foreign_state(fd, tree)
        replace_small(GC_STATE_NAME, content, tree.options.file_mode, dir_fd=fd)


def _refuse_foreign_state(state_fd: int, tree: KVTree) -> None:
    """``UnsafePathError`` if what stands at ``gc.json`` is not a file pykv would have written
    (a link, a FIFO, a directory, a file with another hard link): it is not replaced."""
    try:
        st = os.stat(GC_STATE_NAME, dir_fd=state_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        raise UnsafePathError(errno.EEXIST, "not a file pykv wrote; left in place for 'pykv fsck'",
                              str(tree.state_dir / GC_STATE_NAME))


def last_gc(tree: KVTree) -> dict[str, Any] | None:
    """The summary of the last gc recorded in ``gc.json`` (bounded read; only the fields gc
    writes, of the types it writes them); None if none, unreadable or not what gc writes."""
    try:
        data = json.loads(read_small(tree.state_dir / GC_STATE_NAME))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    summary: dict[str, Any] = {}
    for key, value in data.items():
        expected = _SUMMARY_TYPES.get(key)
        if expected is None or type(value) not in expected:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= _SUMMARY_MAX:
            continue
        summary[key] = value
    freed = data.get("freed_by_namespace")
    if isinstance(freed, dict):
        summary["freed_by_namespace"] = {k: v for k, v in freed.items()
                                         if isinstance(k, str) and type(v) is int and 0 <= v <= MAX_SIZE}
    return summary if 0 < summary.get("finished_at", 0) < _YEAR_10000 else None


_YEAR_10000 = 253402300800  # datetime cannot show a later time


_SUMMARY_MAX = float(MAX_SIZE)
_SUMMARY_TYPES: dict[str, tuple[type, ...]] = {
    **{name: (int,) for name in ("max_size", "total_bytes", "total_files", "freed_bytes", "freed_files",
                                 "vanished_bytes", "vanished_files", "young_files", "young_bytes", "junk_files",
                                 "junk_bytes", "undeleted_files", "undeleted_bytes", "remaining_bytes")},
    "finished_at": (int, float), "seconds": (int, float), "dry_run": (bool,), "target_reached": (bool,)}
