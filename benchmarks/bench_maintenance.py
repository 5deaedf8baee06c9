"""Time ``inspect`` and ``gc`` over a synthetic tree of many small block files.

    python benchmarks/bench_maintenance.py --files 1000000 --root /var/tmp/pykv-bench-maintenance

Builds the tree once (reused when it already holds enough files): one namespace,
blocks of payload length 0 so each file is a valid 4 KiB v1 block written as
its 160 meaningful header bytes plus a sparse tail. Access and publication times
are spread over the past 30 days. Then it times, in this process, the library
calls the CLI makes: a cold inspect (no catalog), a warm one, one without the
catalog, a cold and a warm gc (each freeing ``--free`` of the tree), and prints
the figures. Requirement: inspect and gc over 1 M files in under 60 s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import time
from pathlib import Path

from pykv.format import Geometry, build_header, encode_header
from pykv.maintenance import inspect_tree, run_gc
from pykv.maintenance.catalog import CATALOG_NAME
from pykv.namespace import Namespace
from pykv.tree import KVTree
from pykv.units import format_size

NAMESPACE = Namespace(model="bench/model", dtype="bfloat16", kv_layout="NHD", tokens_per_block=16)
GEOMETRY = Geometry(tokens=16, segments=0, segment_bytes=0)
DAY_NS = 86400 * 10**9


def _write_range(args: tuple[str, int, int, int]) -> int:
    root, start, stop, seed = args
    tree = KVTree.open(root)
    ns_id, fingerprint = NAMESPACE.id, NAMESPACE.fingerprint
    rng = random.Random(seed)
    now = time.time_ns()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for i in range(start, stop):
        key = rng.randbytes(16)
        path = tree.block_path(ns_id, key)
        tree.ensure_parent(path)
        header = encode_header(build_header(fingerprint, key, GEOMETRY, b""))
        assert header is not None
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, header[:160])
            os.ftruncate(fd, len(header))
            mtime = now - rng.randrange(DAY_NS, 30 * DAY_NS)
            os.utime(fd, ns=(rng.randrange(mtime, now), mtime))
        finally:
            os.close(fd)
    return stop - start


def build(root: Path, files: int, workers: int) -> float:
    """Create the tree with ``files`` blocks (keys are random: rare collisions are skipped)."""
    tree = KVTree.create(root)
    tree.ensure_namespace(NAMESPACE)
    started = time.monotonic()
    step = -(-files // (workers * 16))
    chunks = [(str(root), s, min(s + step, files), s) for s in range(0, files, step)]
    with multiprocessing.Pool(workers) as pool:
        pool.map(_write_range, chunks)
    return time.monotonic() - started


def timed(label: str, call):
    started = time.monotonic()
    result = call()
    seconds = time.monotonic() - started
    print(f"{label:<34} {seconds:8.2f} s")
    return result, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1_000_000, help="blocks in the tree (default 1,000,000)")
    parser.add_argument("--root", type=Path, default=Path("/var/tmp/pykv-bench-maintenance"), help="where to build the tree")
    parser.add_argument("--free", type=float, default=0.05, help="fraction of the tree each gc frees")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2, help="processes building the tree")
    parser.add_argument("--rebuild", action="store_true", help="delete and rebuild the tree first")
    args = parser.parse_args()

    if args.rebuild and args.root.exists():
        shutil.rmtree(args.root)
    catalog = args.root / ".pykv" / CATALOG_NAME
    if not (args.root / "pykv-tree.json").exists():
        seconds = build(args.root, args.files, args.workers)
        print(f"{'build ' + format(args.files, ',') + ' files':<34} {seconds:8.2f} s")
    tree = KVTree.open(args.root)

    catalog.unlink(missing_ok=True)
    summary, cold = timed("inspect, cold (builds catalog)", lambda: inspect_tree(tree))
    print(f"  {summary.files:,} blocks, {format_size(summary.bytes)}")
    _, warm = timed("inspect, warm (catalog)", lambda: inspect_tree(tree))
    timed("inspect, --no-catalog", lambda: inspect_tree(tree, use_catalog=False))

    catalog.unlink(missing_ok=True)
    limit = int(summary.bytes * (1 - args.free))
    result, gc_cold = timed(f"gc -{args.free:.0%}, cold (no catalog.db)", lambda: run_gc(tree, limit))
    print(f"  freed {result.freed_files:,} files ({format_size(result.freed_bytes)})")
    limit = int(result.remaining_bytes * (1 - args.free))
    result, gc_warm = timed(f"gc -{args.free:.0%}, warm (catalog)", lambda: run_gc(tree, limit))
    print(f"  freed {result.freed_files:,} files ({format_size(result.freed_bytes)})")
    result, gc_noop = timed("gc, nothing to free (catalog)", lambda: run_gc(tree, limit))
    print(f"slowest: {max(cold, warm, gc_cold, gc_warm, gc_noop):.2f} s (requirement: < 60 s)")


if __name__ == "__main__":
    main()
