"""A summary of what a tree holds: per namespace, files, bytes, ages, temps; the quarantine; the last gc;
the engines' eviction (``pykv.maintenance.evict_record``: last round, last success, behind, STUCK).

Ages are measured from a block's mtime, its publication time (exact even from a
cached scan); recency of access is gc's concern and is read fresh there.

The quarantine (``pykv.maintenance.quarantine``) is counted apart: its files are in no
namespace's counts. Over a device set (``inspect_devices``) the namespaces, ages, temps and
quarantines are summed over all devices, and each device's share comes with its quarantine and
the blocks it holds that the set's placement puts elsewhere (``pykv.maintenance.placement``).
"""

from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from pykv.deviceset import DeviceSet
from pykv.io.safe_paths import read_small
from pykv.maintenance.catalog import scan_tree
from pykv.maintenance.evict_record import eviction_status
from pykv.maintenance.gc import last_gc
from pykv.maintenance.placement import DeviceShare, device_shares
from pykv.maintenance.quarantine import QuarantineUsage, combined, counted
from pykv.maintenance.scan import Entry, Kind, Scan
from pykv.namespace import CODEC_FACT
from pykv.tree import NAMESPACE_FILE, KVTree

#: Upper bounds (seconds) and labels of the age histogram's buckets.
AGE_BUCKETS: tuple[tuple[float, str], ...] = (
    (600, "<10m"), (3600, "<1h"), (86400, "<1d"), (7 * 86400, "<7d"), (30 * 86400, "<30d"), (math.inf, ">=30d"))


def _empty_histogram() -> dict[str, int]:
    return {label: 0 for _, label in AGE_BUCKETS}


_BOUNDS = [bound for bound, _ in AGE_BUCKETS]
_LABELS = [label for _, label in AGE_BUCKETS]


def age_bucket(age_s: float) -> str:
    """The histogram label for an age in seconds."""
    return _LABELS[bisect.bisect_right(_BOUNDS, age_s)]


@dataclass
class NamespaceSummary:
    id: str
    description: str = ""
    fields: dict[str, Any] = field(default_factory=dict)  # namespace.json as written (what keys it)
    files: int = 0
    bytes: int = 0
    temp_files: int = 0
    temp_bytes: int = 0
    foreign: int = 0
    ages: dict[str, int] = field(default_factory=_empty_histogram)


@dataclass
class TreeSummary:
    root: str
    namespaces: list[NamespaceSummary]
    files: int
    bytes: int
    temp_files: int
    temp_bytes: int
    oldest_temp_age_s: float | None
    foreign: int
    ages: dict[str, int]
    last_gc: dict[str, Any] | None
    dirs_listed: int = 0
    dirs_cached: int = 0
    seconds: float = 0.0
    quarantine: QuarantineUsage = QuarantineUsage(0, 0)  # not in the counts above
    eviction: list[dict[str, Any]] = field(default_factory=list)  # per device: ``EvictionStatus.as_dict``

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(root: str, entries: Iterable[Entry], *, now_ns: int) -> TreeSummary:
    """Pure summary of scanned entries (no namespace descriptions, no gc state)."""
    spaces: dict[str | None, NamespaceSummary] = {}
    oldest_temp_ns: int | None = None
    for entry in entries:
        space = spaces.get(entry.namespace)
        if space is None:
            space = spaces[entry.namespace] = NamespaceSummary(entry.namespace or "")
        if entry.kind is Kind.BLOCK:
            space.files += 1
            space.bytes += entry.size
            space.ages[age_bucket((now_ns - entry.mtime_ns) / 1e9)] += 1
        elif entry.kind is Kind.TEMP:
            space.temp_files += 1
            space.temp_bytes += entry.size
            oldest_temp_ns = entry.mtime_ns if oldest_temp_ns is None else min(oldest_temp_ns, entry.mtime_ns)
        elif entry.kind is Kind.FOREIGN:
            space.foreign += 1
    namespaces = sorted(spaces.values(), key=lambda s: (-s.bytes, s.id))
    ages = _empty_histogram()
    for space in namespaces:
        for label, count in space.ages.items():
            ages[label] += count
    return TreeSummary(
        root=root, namespaces=namespaces,
        files=sum(s.files for s in namespaces), bytes=sum(s.bytes for s in namespaces),
        temp_files=sum(s.temp_files for s in namespaces), temp_bytes=sum(s.temp_bytes for s in namespaces),
        oldest_temp_age_s=None if oldest_temp_ns is None else (now_ns - oldest_temp_ns) / 1e9,
        foreign=sum(s.foreign for s in namespaces), ages=ages, last_gc=None)


def read_namespace_fields(tree: KVTree, namespace_id: str) -> dict[str, Any]:
    """``namespace.json`` of a namespace, ``extra`` flattened into ``extra.<key>``; {} if unreadable."""
    try:
        data = json.loads(read_small(tree.namespace_dir(namespace_id) / NAMESPACE_FILE))
        if not isinstance(data, dict):
            return {}
        extra = data.pop("extra", None)
        data.pop("id", None)
        if isinstance(extra, dict):
            data.update({f"extra.{k}": v for k, v in extra.items()})
        return {key: _shallow(value) for key, value in data.items()}
    except (OSError, ValueError, RecursionError):
        return {}


_MAX_FIELD_DEPTH = 16  # namespace.json holds flat fields; deeper values cannot be printed without recursion


def _shallow(value: Any, depth: int = 0) -> Any:
    """``value`` if its lists and objects nest at most ``_MAX_FIELD_DEPTH`` deep, else a note saying so
    (a field nested hundreds deep, which JSON parses, would exhaust the stack when printed)."""
    if depth >= _MAX_FIELD_DEPTH:
        return "(nested too deeply)"
    if isinstance(value, list):
        return [_shallow(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {key: _shallow(item, depth + 1) for key, item in value.items()}
    return value


def describe_namespace(fields: dict[str, Any]) -> str:
    """A short description (model, dtype, ranks, block tokens, hash seed, a codec other than
    ``none`` by its name); '' if unreadable."""
    try:
        text = (f"{fields.get('label') or fields['model']} {fields['dtype']} tp{fields.get('tp_rank', 0)}/"
                f"{fields.get('tp_size', 1)} pp{fields.get('pp_rank', 0)} {fields['tokens_per_block']} tokens/block")
    except (KeyError, TypeError):
        return ""
    seed = fields.get("extra.block_hash_seed")
    codec = fields.get(f"extra.{CODEC_FACT}")
    return (text + (f" seed {str(seed)[:16]}" if seed is not None else "")
            + (f" codec {str(codec).partition(':')[0][:32]}" if codec is not None else ""))


def _add_differences(namespaces: list[NamespaceSummary]) -> None:
    """Where two namespaces read alike, append the fields that tell them apart."""
    by_text: dict[str, list[NamespaceSummary]] = {}
    for space in namespaces:
        if space.description:
            by_text.setdefault(space.description, []).append(space)
    for group in (g for g in by_text.values() if len(g) > 1):
        keys = sorted({k for s in group for k in s.fields if k != "label"})
        differing = [k for k in keys if len({json.dumps(s.fields.get(k), sort_keys=True) for s in group}) > 1]
        for space in group:
            space.description += "".join(f" {k}={space.fields.get(k)}" for k in differing)


def inspect_tree(tree: KVTree, *, use_catalog: bool = True) -> TreeSummary:
    """Scan ``tree`` (through the catalog when possible) and summarize it."""
    return _inspect([tree], use_catalog=use_catalog)[0]


@dataclass
class DeviceSetSummary:
    """A set's summary: namespaces, ages and temps over all devices, and each device's share."""

    summary: TreeSummary  # its ``root``: the first device's
    devices: list[DeviceShare]
    last_gcs: list[dict[str, Any] | None]  # per device
    quarantines: list[QuarantineUsage] = field(default_factory=list)  # per device

    def as_dict(self) -> dict[str, Any]:
        """``TreeSummary.as_dict`` with ``roots`` for ``root`` and a ``devices`` table (each
        device's share, its unreachable blocks and its last gc)."""
        data = self.summary.as_dict()
        del data["root"]
        devices = [{**share.as_dict(), "last_gc": gc, "quarantine": quarantine.as_dict(), "eviction": eviction}
                   for share, gc, quarantine, eviction
                   in zip(self.devices, self.last_gcs, self.quarantines, self.summary.eviction)]
        return {"roots": [share.root for share in self.devices], **data, "devices": devices,
                "unreachable_blocks": sum(share.unreachable_blocks for share in self.devices),
                "unreachable_bytes": sum(share.unreachable_bytes for share in self.devices)}


def inspect_devices(devices: DeviceSet, *, use_catalog: bool = True) -> DeviceSetSummary:
    """Scan every device of ``devices`` (each through its catalog when possible) and summarize the set."""
    summary, scans, gcs, quarantines = _inspect(devices.trees, use_catalog=use_catalog)
    return DeviceSetSummary(summary, device_shares(devices, [scan.entries for scan in scans]), gcs, quarantines)


def _inspect(trees: Sequence[KVTree], *, use_catalog: bool
             ) -> tuple[TreeSummary, list[Scan], list[dict | None], list[QuarantineUsage]]:
    """The summary over ``trees`` (``root``: the first's; the last gc: the latest of theirs; the
    quarantine: theirs summed), their scans, each one's last gc and each one's quarantine."""
    started = time.monotonic()
    scans = [scan_tree(tree, use_catalog=use_catalog) for tree in trees]
    summary = summarize(str(trees[0].root), (e for scan in scans for e in scan.entries), now_ns=time.time_ns())
    for space in summary.namespaces:
        if space.id:  # every device holds the namespace's record; the first readable one counts
            space.fields = next((found for tree in trees if (found := read_namespace_fields(tree, space.id))), {})
            space.description = describe_namespace(space.fields)
    _add_differences(summary.namespaces)
    gcs = [last_gc(tree) for tree in trees]
    summary.last_gc = max((gc for gc in gcs if gc), key=lambda gc: gc["finished_at"], default=None)
    summary.dirs_listed = sum(scan.dirs_listed for scan in scans)
    summary.dirs_cached = sum(scan.dirs_cached for scan in scans)
    quarantines = [counted(tree) for tree in trees]
    summary.quarantine = combined(quarantines)
    now = time.time()
    summary.eviction = [eviction_status(tree, now).as_dict() for tree in trees]
    summary.seconds = time.monotonic() - started
    return summary, scans, gcs, quarantines
