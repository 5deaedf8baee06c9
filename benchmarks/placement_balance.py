#!/usr/bin/env python3
"""How evenly one request's blocks land on a device set: first choice alone vs ``place``.

A load from independent devices lasts as long as the busiest device's share, so the share
of the set's bandwidth one request can use is mean / max of its blocks per device. For
requests of 8k / 32k / 80k tokens (256-token blocks) on N devices with fresh tree
identities per trial, this prints that ratio with the rendezvous first choice alone and with
``StripedMedium.place`` (three choices), the request stored in ``--job`` blocks per store
(one 8k-token prefill step: 32) after an earlier request of the same length, through pykv's
own placement code.

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

from pykv.deviceset import DeviceSet, rendezvous_top  # noqa: E402
from pykv.media.build import open_store_medium  # noqa: E402
from pykv.tree import KVTree  # noqa: E402

NAMESPACE = "00c0ffee"
TOKENS_PER_BLOCK = 256


def efficiency(lanes: list[int], devices: int) -> float:
    counts = Counter(lanes)
    return (len(lanes) / devices) / max(counts.values())


def two_per_store(device_set: DeviceSet, stores: list[list[bytes]]) -> list[int]:
    """The rule before run 17, for comparison: two candidates, each block on the one holding fewer of
    its store's blocks (then fewer placed in all)."""
    placed, lanes = [0] * len(device_set), []
    for keys in stores:
        in_store = [0] * len(device_set)
        for key in keys:
            index = min(rendezvous_top(key, device_set.seeds, 2), key=lambda i: (in_store[i], placed[i]))
            in_store[index] += 1
            placed[index] += 1
            lanes.append(index)
    return lanes


def trial(base: Path, devices: int, blocks: int, job: int) -> tuple[float, float, float]:
    roots = []
    for i in range(devices):
        root = Path(tempfile.mkdtemp(prefix=f"dev{i}-", dir=base))
        roots.append(KVTree.create(root))
    device_set = DeviceSet(roots)
    medium = open_store_medium(device_set)
    earlier = [os.urandom(16) for _ in range(blocks)]
    medium.place(NAMESPACE, earlier)
    keys = [os.urandom(16) for _ in range(blocks)]
    stores = [keys[start:start + job] for start in range(0, blocks, job)]
    first = [device_set.index_of(key) for key in keys]
    two = two_per_store(device_set, [earlier] + stores)[blocks:]
    placed = [medium.lane(location) for store in stores for location in medium.place(NAMESPACE, store)]
    return efficiency(first, devices), efficiency(two, devices), efficiency(placed, devices)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--lengths", default="8192,32768,81920", help="request lengths in tokens")
    p.add_argument("--job", type=int, default=32, help="blocks per store job")
    a = p.parse_args()
    print(f"{a.devices} devices, {a.trials} trials per length: mean / p10 of (mean blocks per device) / "
          f"(busiest device's blocks)")
    print(f"{'tokens':>7} {'blocks':>6}  {'first choice':>14}  {'two, per store':>14}  {'place':>14}")
    with tempfile.TemporaryDirectory(prefix="pykv-placement-") as tmp:
        for length in (int(x) for x in a.lengths.split(",")):
            blocks = length // TOKENS_PER_BLOCK
            base = Path(tmp) / str(length)
            base.mkdir()
            runs = [trial(base, a.devices, blocks, a.job) for _ in range(a.trials)]
            cells = []
            for column in zip(*runs):
                ordered = sorted(column)
                cells.append(f"{statistics.mean(column):6.1%} / {ordered[len(ordered) // 10]:5.1%}")
            print(f"{length:>7,} {blocks:>6}  {cells[0]:>14}  {cells[1]:>14}  {cells[2]:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
