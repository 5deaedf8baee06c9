"""What each device of a tree did during one request, from the kernel's block statistics.

``/sys/dev/block/MAJ:MIN/stat`` of the device a root's filesystem sits on (its ``st_dev``): bytes
read and ``io_ticks``, the milliseconds the device had requests in flight. Beside a load job's time
they tell whether the devices were kept busy (busy share near 1: the devices' own speed bounds the
load; well under 1: the load path left them idle) and how evenly one request's blocks fell on them.
"""

from __future__ import annotations

import os

SECTOR = 512
READ_SECTORS, READ_TICKS, IO_TICKS = 2, 3, 9
"""Fields of the stat file (Documentation/block/stat.rst): sectors read, ms spent reading, ms busy."""


def stat_paths(roots: list[str]) -> dict[str, str]:
    """Device name -> its stat file, for the devices under ``roots`` (roots that are missing or not on
    a block device are left out)."""
    paths: dict[str, str] = {}
    for root in roots:
        try:
            dev = os.stat(root).st_dev
        except OSError:
            continue
        path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        if os.path.exists(f"{path}/stat"):
            paths[os.path.basename(os.path.realpath(path))] = f"{path}/stat"
    return paths


def snapshot(paths: dict[str, str]) -> dict[str, list[int]]:
    """Each device's stat fields now (a device whose file cannot be read is left out)."""
    snap = {}
    for name, path in paths.items():
        try:
            with open(path) as f:
                snap[name] = [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return snap


def delta(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, dict[str, int]]:
    """Per device between two snapshots: bytes read, ms busy, ms summed over its reads."""
    out = {}
    for name in sorted(set(before) & set(after)):
        b, a = before[name], after[name]
        if len(a) <= IO_TICKS or len(b) <= IO_TICKS:
            continue
        out[name] = {"read_bytes": (a[READ_SECTORS] - b[READ_SECTORS]) * SECTOR,
                     "busy_ms": a[IO_TICKS] - b[IO_TICKS], "read_ms": a[READ_TICKS] - b[READ_TICKS]}
    return out
