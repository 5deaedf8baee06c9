"""Tree maintenance: scanning, the scan catalog, gc, fsck, inspect and the quarantine's count.

Library functions behind ``pykv inspect``, ``pykv gc`` and ``pykv fsck``; none of
them is on the serving path. They are safe to run while vLLM instances read and
write the tree: files vanishing mid-scan are expected, never errors.
"""

from pykv.maintenance.catalog import Catalog, scan_tree
from pykv.maintenance.fsck import Finding, FsckReport, Problem, check_block_file, fsck, fsck_devices, repair
from pykv.maintenance.gc import GcPlan, GcResult, collect, last_gc, plan_gc, record_gc, run_gc, run_gc_devices
from pykv.maintenance.inspect import (DeviceSetSummary, NamespaceSummary, TreeSummary, inspect_devices, inspect_tree,
                                      summarize)
from pykv.maintenance.quarantine import QuarantineUsage, quarantine_usage
from pykv.maintenance.scan import Entry, Kind, LeafDir, Scan, list_leaf, walk, walk_structure

__all__ = [
    "Catalog", "DeviceSetSummary", "Entry", "Finding", "FsckReport", "GcPlan", "GcResult", "Kind", "LeafDir",
    "NamespaceSummary", "Problem", "QuarantineUsage", "Scan", "TreeSummary", "check_block_file", "collect", "fsck", "fsck_devices",
    "inspect_devices", "inspect_tree", "last_gc", "list_leaf", "plan_gc", "quarantine_usage", "record_gc", "repair",
    "run_gc", "run_gc_devices", "scan_tree", "summarize", "walk", "walk_structure",
]
