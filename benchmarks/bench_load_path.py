"""Host CPU per block of the reactor's load path: many small blocks from a memory-backed tree
(page cache: no device time), loaded through each backend, best of ``--repeat`` passes.

    python benchmarks/bench_load_path.py [--blocks 2000] [--repeat 5] [--dir /dev/shm]

CPU time (all threads of the process) is the figure to compare: it moves less than wall
time when other work shares the machine. The reactor thread's own CPU is printed beside it: what
that one thread holds the GIL for (its Python and system calls) while a load runs. What it
measures is the per-block work of open, fstat, header check, read, checksum and close as the
serving path does it (no GPU): the figure to keep when the load path changes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reliability.rig import Rig, geometry_of, key_of  # noqa: E402


def reactor_thread() -> threading.Thread:
    """The one live reactor's thread (the bench runs one rig at a time)."""
    return next(t for t in threading.enumerate() if t.name == "pykv-reactor" and t.is_alive())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pykv-bench-load-", dir=args.dir))
    try:
        for backend in ("threadpool", "io_uring"):
            with Rig(work / backend, backend=backend, max_payload=16384, slots=64, io_depth=16,
                     direct=False, keep_payloads=False) as rig:
                if rig.reactor.backend.name != backend:
                    print(f"{backend}: unavailable")
                    continue
                keys = [key_of(i) for i in range(args.blocks)]
                geometries = [geometry_of(k, 16384, 16384) for k in keys]
                for start in range(0, len(keys), args.batch):
                    rig.store(keys[start:start + args.batch], geometries[start:start + args.batch])
                reactor_clock = time.pthread_getcpuclockid(reactor_thread().ident)
                best_wall = best_cpu = best_reactor = float("inf")
                for _ in range(args.repeat):
                    wall, cpu = time.perf_counter(), time.process_time()
                    reactor = time.clock_gettime(reactor_clock)
                    for start in range(0, len(keys), args.batch):
                        outcome = rig.load(keys[start:start + args.batch])
                        assert not outcome.result.failed, outcome.result.failed
                    best_reactor = min(best_reactor, time.clock_gettime(reactor_clock) - reactor)
                    best_wall = min(best_wall, time.perf_counter() - wall)
                    best_cpu = min(best_cpu, time.process_time() - cpu)
                print(f"{backend}: {best_cpu / args.blocks * 1e6:.1f} us CPU ({best_reactor / args.blocks * 1e6:.1f} "
                      f"on the reactor thread), {best_wall / args.blocks * 1e6:.1f} us wall per block "
                      f"({args.blocks} blocks of 16 KiB, best of {args.repeat})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
