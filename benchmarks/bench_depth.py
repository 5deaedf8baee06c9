"""When do a request's blocks arrive, per number of reads in flight on each device? (issue 17)

pykv's reactor loads ``--blocks`` block files from every directory in ``--dirs`` (one device
each; keys placed evenly, as ``pykv bench --files`` does) at each ``--depths`` value of
``io_depth``, page cache dropped between store and load. Printed per depth (medians of
``--repeat`` rounds, depths interleaved): the whole load, the first, the 25 % and the 50 %
block delivered, and GB/s. Large reads queued deep on one device are served piece by piece in
turn, so every block arrives late and together; fewer in flight deliver them one after another.

    python benchmarks/bench_depth.py --dirs /mnt/l0,/mnt/l1 [--blocks 16] [--depths 16,8,4,2]

Run 15's CPU figures (benchmarks/results/history/29-run-15-copy-check-depth.md) came from 4 ext4 loop devices on images in /dev/shm.
No GPU; a directory on tmpfs itself takes no O_DIRECT and measures buffered reads instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pykv.bench import block_files, drop_page_cache  # noqa: E402


def load_once(dirs: list[Path], *, blocks: int, depth: int, engine: str, verify: str, block_mib: int) -> tuple:
    """(seconds, first, 25 %, 50 % delivery in seconds, GB/s) of one store-then-load round."""
    with block_files(engine, dirs, blocks_per_device=blocks, block_size=block_mib << 20, depth=depth,
                     verify=verify) as files:
        reactor = files.reactor
        reactor.write("store", files.stores)
        stored = reactor.wait_for("store")
        if stored.failed:
            raise OSError(f"store failed: {next(iter(stored.failed.values()))}")
        for block in files.stores:
            drop_page_cache(block.path)
        sink, delivered = reactor.sink, []
        deliver = sink.deliver

        def timed(ready) -> None:
            delivered.extend([time.perf_counter()] * len(ready))
            deliver(ready)
        sink.deliver = timed
        began = time.perf_counter()
        reactor.read("load", files.loads)
        loaded = reactor.wait_for("load")
        seconds = time.perf_counter() - began
        if loaded.failed:
            raise OSError(f"load failed: {next(iter(loaded.failed.values()))}")
        times = sorted(t - began for t in delivered)
        return seconds, times[0], times[len(times) // 4], times[len(times) // 2], loaded.bytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dirs", required=True, help="comma-separated directories, one per device")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per device")
    parser.add_argument("--depths", default="16,8,4,2")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engine", default="io_uring", choices=("io_uring", "threadpool"))
    parser.add_argument("--verify", default="full", choices=("full", "header"))
    parser.add_argument("--block-mib", type=int, default=28)
    a = parser.parse_args()
    dirs = [Path(d) for d in a.dirs.split(",") if d]
    depths = [int(d) for d in a.depths.split(",") if d]
    rounds: dict[int, list[tuple]] = {d: [] for d in depths}
    for _ in range(a.repeat):
        for depth in depths:
            rounds[depth].append(load_once(dirs, blocks=a.blocks, depth=depth, engine=a.engine, verify=a.verify,
                                           block_mib=a.block_mib))
    print(f"{len(dirs)} devices, {a.blocks} blocks of {a.block_mib} MiB each, {a.engine}, verify={a.verify}, "
          f"medians of {a.repeat}")
    for depth, results in rounds.items():
        m = [statistics.median(r[i] for r in results) for i in range(5)]
        print(f"depth {depth:3d}: load {m[0] * 1e3:5.0f} ms, first block {m[1] * 1e3:4.0f} ms, "
              f"25 % {m[2] * 1e3:4.0f} ms, 50 % {m[3] * 1e3:4.0f} ms, {m[4]:.2f} GB/s")


if __name__ == "__main__":
    main()
