"""What a disk hit's access stamps cost the load they run beside: a reactor load of N blocks from a
memory-backed tree, alone, beside N stamps made one call per file on the devices' threads (the
shape before session 36: ``stat`` and ``utime`` of a pathlib path), and beside ``DiskPresence.stamp``
(``STAMP_BATCH`` files per call, each opened beneath the root: ``KVTree.stamp``).

    python benchmarks/bench_stamps.py [--blocks 320] [--devices 8] [--rounds 60] [--dir /dev/shm]

The scheduler stamps a hit's files when it plans the load, so in one engine process the stamps
share the GIL and the cores with the reactor while the load runs. Wall time per load, median and
quartiles over the rounds (the three shapes alternate); no GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reliability.rig import Rig, geometry_of, key_of  # noqa: E402

from pykv.deviceset import DeviceSet  # noqa: E402
from pykv.lanes import LaneCalls  # noqa: E402
from pykv.presence import DiskPresence  # noqa: E402

NS = "0c" * 8


def stamped_set(work: Path, devices: int, keys: list[bytes]) -> DeviceSet:
    """``devices`` trees, each key's file published on its first candidate."""
    roots = [work / f"dev{i}" for i in range(devices)]
    for root in roots:
        root.mkdir()
    device_set = DeviceSet.create(roots)
    for key in keys:
        path = device_set[device_set.candidates(key)[0]].block_path(NS, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    return device_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=320)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pykv-bench-stamps-", dir=args.dir))
    try:
        keys = [key_of(i) for i in range(args.blocks)]
        device_set = stamped_set(work, args.devices, keys)
        presence = DiskPresence(device_set, [NS], deadline=5.0)
        per_file = LaneCalls(args.devices, 5.0)

        def stamp_one(item: tuple[int, bytes]) -> None:  # the stamp as it was: by path, through pathlib
            device, key = item
            path = device_set[device].block_path(NS, key)
            os.utime(path, ns=(time.time_ns(), os.stat(path, follow_symlinks=False).st_mtime_ns),
                     follow_symlinks=False)

        shapes = {
            "alone": lambda: None,
            "one call per file": lambda: per_file.start(
                stamp_one, [(device, (device, key)) for key in keys
                            for device in [device_set.candidates(key)[0]]]),
            "DiskPresence.stamp": lambda: presence.stamp(keys),
        }
        walls: dict[str, list[float]] = {name: [] for name in shapes}
        with Rig(work / "rig", backend="auto", max_payload=65536, slots=64, io_depth=16, direct=False,
                 keep_payloads=False) as rig:
            rig.store(keys, [geometry_of(key, 65536, 65536) for key in keys])
            for _ in range(args.rounds):
                for name, start_stamps in shapes.items():
                    began = time.perf_counter()
                    start_stamps()
                    outcome = rig.load(keys)
                    walls[name].append(time.perf_counter() - began)
                    assert not outcome.result.failed, outcome.result.failed
                    time.sleep(0.05)  # the stamps finish before the next shape
        presence.close(5)
        per_file.close(5)
        for name, values in walls.items():
            low, median, high = statistics.quantiles(values, n=4)
            print(f"{name:>20}: {median * 1e3:6.1f} ms per load of {args.blocks} blocks of 64 KiB "
                  f"(quartiles {low * 1e3:.1f}-{high * 1e3:.1f}; {args.devices} devices, {args.rounds} rounds)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
