#!/usr/bin/env python3
"""How evenly one request's blocks land on a device set: first choice alone vs two choices.

A load from independent devices lasts as long as the busiest device's share, so the share
of the set's bandwidth one request can use is mean / max of its blocks per device. For
requests of 8k / 32k / 80k tokens (256-token blocks) on N devices with fresh tree
identities per trial, this prints that ratio with the rendezvous first choice alone and with
``StripedMedium.place`` (two choices), through pykv's own placement code.

    python benchmarks/placement_balance.py --devices 8 --trials 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pykv.deviceset import DeviceSet  # noqa: E402
from pykv.store import open_store_medium  # noqa: E402
from pykv.tree import KVTree  # noqa: E402

NAMESPACE = "00c0ffee"
TOKENS_PER_BLOCK = 256


def efficiency(lanes: list[int], devices: int) -> float:
    counts = Counter(lanes)
    return (len(lanes) / devices) / max(counts.values())


def trial(base: Path, devices: int, blocks: int) -> tuple[float, float]:
    roots = []
    for i in range(devices):
        root = Path(tempfile.mkdtemp(prefix=f"dev{i}-", dir=base))
        roots.append(KVTree.create(root))
    device_set = DeviceSet(roots)
    medium = open_store_medium(device_set)
    keys = [os.urandom(16) for _ in range(blocks)]
    first = [device_set.index_of(key) for key in keys]
    two = [medium.lane(location) for location in medium.place(NAMESPACE, keys)]
    return efficiency(first, devices), efficiency(two, devices)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--lengths", default="8192,32768,81920", help="request lengths in tokens")
    a = p.parse_args()
    print(f"{a.devices} devices, {a.trials} trials per length: mean / p10 of (mean blocks per device) / "
          f"(busiest device's blocks)")
    print(f"{'tokens':>7} {'blocks':>6}  {'first choice':>14}  {'two choices':>14}")
    with tempfile.TemporaryDirectory(prefix="pykv-placement-") as tmp:
        for length in (int(x) for x in a.lengths.split(",")):
            blocks = length // TOKENS_PER_BLOCK
            base = Path(tmp) / str(length)
            base.mkdir()
            runs = [trial(base, a.devices, blocks) for _ in range(a.trials)]
            cells = []
            for column in zip(*runs):
                ordered = sorted(column)
                cells.append(f"{statistics.mean(column):6.1%} / {ordered[len(ordered) // 10]:5.1%}")
            print(f"{length:>7,} {blocks:>6}  {cells[0]:>14}  {cells[1]:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
