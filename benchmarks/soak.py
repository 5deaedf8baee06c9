"""Soak: mixed stores, loads, gc and fsck on one tree held at its size limit, for a long time.

usage: python benchmarks/soak.py --minutes 30 --root DIR --max-size 1G [--storers 2] [--loaders 2]
                                 [--block-size 1M-4M] [--rate 10M] [--gc-interval 2s] [--evict gc|engine]
                                 [--json OUT]
       python benchmarks/soak.py --juicefs WORK ...   (one JuiceFS volume mounted three times)

``--root`` may be given several times: the same tree seen through several mounts (clients
of a shared file system). Storers and loaders take them in turn; gc and fsck use the last
one when there are three or more, so they run on a client of their own. ``--juicefs WORK``
formats a JuiceFS volume under WORK (SQLite metadata, a local bucket), mounts it three
times and uses ``clientN/kv`` on each as the roots (tests/juicefs_volume.py).

Storers and loaders are separate processes, each with its own reactor (the engine's
store and load path: io_uring or the thread pool, O_DIRECT where the disk takes it);
every payload is a pure function of its key, so each load is checked byte for byte.
The key space holds about three times ``--max-size``: a gc process (``run_gc``, what
``pykv gc --min-age 0`` runs) holds the tree at its limit while the others work, and
loads hit, miss, or lose their block to gc mid-flight. An fsck process checks the
live tree every few minutes. At the end: one last gc and an fsck with no grace.

With ``--evict engine`` no gc process runs: each storer keeps the tree under
``--max-size`` the way an engine with ``max_tree_bytes`` does (a ``TreeEvictor`` on its
own thread, rounds every ``--gc-interval`` and after each 5 % of the limit stored, one
storer at a time under the tree's lease, ``evict_min_age`` 0), and the collector only
samples the tree's block bytes every second (``tree_bytes``: min, max, mean).

Counted as errors (the run must end with 0): a failed store, a failed load other than a
plain miss (the block is not there), a delivered block with wrong bytes, an exception
in any process, and any fsck finding. Prints a summary (and ``--json``) for
``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the reliability tests' rig

from pykv.deviceset import DeviceSet  # noqa: E402
from pykv.maintenance import fsck, run_gc  # noqa: E402
from pykv.maintenance.evictor import EvictionPolicy, TreeEvictor  # noqa: E402
from pykv.maintenance.scan import Kind, Scan  # noqa: E402
from pykv.tree import KVTree  # noqa: E402
from pykv.units import format_size, parse_duration, parse_size  # noqa: E402

from reliability.rig import NS, Rig, geometry_of, key_of  # noqa: E402
from reliability.system import collect, spawn  # noqa: E402

FSCK_INTERVAL_S = 300.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--root", action="append", dest="roots",
                       help="tree to use (created; its blocks are the soak's own); repeat for several mounts of it")
    where.add_argument("--juicefs", metavar="WORK", help="mount a new JuiceFS volume three times under WORK")
    p.add_argument("--max-size", default="1G", help="size limit gc holds the tree at")
    p.add_argument("--storers", type=int, default=2)
    p.add_argument("--loaders", type=int, default=2)
    p.add_argument("--block-size", default="1M-4M", help="payload size range of a block, MIN-MAX")
    p.add_argument("--rate", default="10M", help="bytes per second each storer and each loader moves at most")
    p.add_argument("--gc-interval", default="2s")
    p.add_argument("--evict", choices=("gc", "engine"), default="gc",
                   help="gc: a gc process holds the limit; engine: each storer evicts as an engine with "
                        "max_tree_bytes does (under the tree's lease)")
    p.add_argument("--json", help="write the summary here too")
    args = p.parse_args(argv)
    low, _, high = args.block_size.partition("-")
    args.min_block, args.max_block = parse_size(low), parse_size(high or low)
    args.max_bytes, args.rate_bytes = parse_size(args.max_size), parse_size(args.rate)
    args.gc_interval_s = parse_duration(args.gc_interval)
    average = (args.min_block + args.max_block) / 2
    args.keys = max(16, int(3 * args.max_bytes / average))
    return args


def role_root(args: argparse.Namespace, seed: int, maintenance: bool = False) -> str:
    """The mount a role works through: storers and loaders in turn, gc and fsck on the last of three or more."""
    roots = args.roots
    if maintenance:
        return roots[-1]
    workers = roots[:-1] if len(roots) >= 3 else roots
    return workers[seed % len(workers)]


def _geometry(args: argparse.Namespace, key: bytes):
    return geometry_of(key, args.min_block, args.max_block)


def _keys(args: argparse.Namespace, rng: random.Random) -> list[bytes]:
    return [key_of(rng.randrange(args.keys)) for _ in range(rng.randint(1, 4))]


def _rig(args: argparse.Namespace, seed: int) -> Rig:
    """A reactor of its own; odd seeds use io_uring, even ones the thread pool."""
    return Rig(role_root(args, seed), create=False, backend="io_uring" if seed % 2 else "threadpool", max_payload=args.max_block,
               slots=6, keep_payloads=False)


def _pace(started: float, moved: int, rate: int) -> None:
    ahead = moved / rate - (time.monotonic() - started)
    if ahead > 0:
        time.sleep(ahead)


def _paced_jobs(args: argparse.Namespace, seed: int, deadline: float, job) -> dict:
    """Run ``job(rig, keys, counts, errors)`` on random keys until ``deadline``, paced at ``--rate``
    by the byte count ``job`` returns."""
    rng, counts, errors = random.Random(seed), Counter(), []
    with _rig(args, seed) as rig:
        started = time.monotonic()
        while time.monotonic() < deadline:
            _pace(started, job(rig, _keys(args, rng), counts, errors), args.rate_bytes)
    return {"counts": counts, "errors": errors[:50], "error_count": len(errors)}


def storer(args: argparse.Namespace, seed: int, deadline: float) -> dict:
    evictor = None if args.evict != "engine" else TreeEvictor(
        DeviceSet([KVTree.open(role_root(args, seed))]), EvictionPolicy(args.max_bytes, 0.0, args.gc_interval_s)).start()

    def store(rig: Rig, keys: list[bytes], counts: Counter, errors: list[str]) -> int:
        out = rig.store(keys, [_geometry(args, k) for k in keys], timeout=300)
        counts["store_jobs"] += 1
        counts["store_blocks"] += len(keys)
        counts["published"] += out.result.published
        counts["store_bytes"] += out.result.bytes
        errors += [f"store {keys[i].hex()}: {reason}" for i, reason in out.result.failed.items()]
        if evictor is not None:
            evictor.note_stored(out.result.bytes)
        return counts["store_bytes"]
    try:
        result = _paced_jobs(args, seed, deadline, store)
    finally:
        if evictor is not None:
            evictor.close(timeout=300)
    if evictor is not None:  # pykv:evict_rounds -> evict_rounds, ...
        result["counts"].update({name.split(":", 1)[1]: value for name, value in evictor.stats().items()})
        if evictor.stats().get("pykv:evict_errors"):
            result["errors"].append(f"{evictor.stats()['pykv:evict_errors']} eviction rounds failed (see the log)")
            result["error_count"] += 1
    return result


def loader(args: argparse.Namespace, seed: int, deadline: float) -> dict:
    def load(rig: Rig, keys: list[bytes], counts: Counter, errors: list[str]) -> int:
        out = rig.load(keys, [_geometry(args, k) for k in keys], timeout=300)
        counts["load_jobs"] += 1
        counts["load_hits"] += len(out.delivered)
        counts["load_misses"] += len(out.misses)
        counts["load_bytes"] += out.result.bytes
        errors += [f"load {keys[i].hex()}: {reason}" for i, reason in out.errors.items()]
        errors += [f"load {keys[i].hex()}: wrong bytes delivered" for i in out.mismatched]
        return max(counts["load_bytes"], counts["load_jobs"] * args.min_block)
    return _paced_jobs(args, seed, deadline, load)


def collector(args: argparse.Namespace, seed: int, deadline: float) -> dict:
    tree, counts = KVTree.open(role_root(args, seed, maintenance=True)), Counter()
    sizes = []
    if args.evict == "engine":  # the storers evict: sample the tree's size every second
        while time.monotonic() < deadline:
            sizes.append(sum(e.size for e in Scan.of(tree).entries if e.kind is Kind.BLOCK))
            time.sleep(1.0)
        settled = sizes[len(sizes) // 4:] or sizes
        return {"counts": counts, "errors": [], "error_count": 0,
                "tree_bytes": {"min": min(settled, default=0), "max": max(sizes, default=0),
                               "mean": sum(settled) / max(len(settled), 1), "samples": len(sizes)}}
    while time.monotonic() < deadline:
        result = run_gc(tree, args.max_bytes, min_age_s=0)
        counts["gc_runs"] += 1
        counts["gc_freed_files"] += result.freed_files
        counts["gc_freed_bytes"] += result.freed_bytes
        counts["gc_vanished_files"] += result.vanished_files
        sizes.append(result.total_bytes)
        time.sleep(args.gc_interval_s)
    settled = sizes[len(sizes) // 4:] or sizes  # after the first quarter: the tree has reached its limit
    return {"counts": counts, "errors": [], "error_count": 0,
            "tree_bytes_before_gc": {"min": min(settled, default=0), "max": max(settled, default=0),
                                     "mean": sum(settled) / max(len(settled), 1)}}


def checker(args: argparse.Namespace, seed: int, deadline: float) -> dict:
    tree, counts, errors = KVTree.open(role_root(args, seed, maintenance=True)), Counter(), []
    next_run = time.monotonic() + min(FSCK_INTERVAL_S, max((deadline - time.monotonic()) / 2, 1))
    while time.monotonic() < deadline:
        if time.monotonic() < next_run:
            time.sleep(1)
            continue
        report = fsck(tree, grace_s=60)  # young temps belong to storers at work
        counts["fsck_runs"] += 1
        counts["fsck_blocks"] += report.blocks_checked
        errors += [f"fsck: {f.path}: {f.problem.value}: {f.detail}" for f in report.findings]
        next_run = time.monotonic() + FSCK_INTERVAL_S
    return {"counts": counts, "errors": errors[:50], "error_count": len(errors)}


def soak(args: argparse.Namespace) -> dict:
    tree = KVTree.create(args.roots[0])
    tree.ensure_namespace(NS)
    started = time.time()
    deadline = time.monotonic() + args.minutes * 60
    roles = [storer] * args.storers + [loader] * args.loaders + [collector, checker]
    children = [spawn(role, args, seed, deadline) for seed, role in enumerate(roles)]
    results = [{"role": role.__name__, "counts": {}, **collect(child)} for role, child in zip(roles, children)]
    counts = Counter()
    for r in results:
        counts.update(r["counts"])
    final_gc = run_gc(tree, args.max_bytes, min_age_s=0)
    final = fsck(tree, grace_s=0)
    errors = sum(r["error_count"] for r in results) + len(final.findings)
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "minutes": round((time.time() - started) / 60, 1),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "settings": {"roots": args.roots, "file_system": "JuiceFS, three clients" if args.juicefs else "local",
                     "max_size": args.max_bytes, "storers": args.storers, "loaders": args.loaders,
                     "block_size": [args.min_block, args.max_block], "keys": args.keys, "rate": args.rate_bytes,
                     "evict": args.evict},
        "operations": dict(counts),
        "tree_bytes_before_gc": next((r.get("tree_bytes_before_gc", {}) for r in results if r["role"] == "collector"),
                                     {}),
        "tree_bytes": next((r.get("tree_bytes", {}) for r in results if r["role"] == "collector"), {}),
        "final_gc": {"total_bytes": final_gc.total_bytes, "remaining_bytes": final_gc.remaining_bytes,
                     "target_reached": final_gc.target_reached},
        "final_fsck": {"clean": final.clean, "blocks_checked": final.blocks_checked,
                       "bytes_checked": final.bytes_checked, "findings": [f.as_dict() for f in final.findings]},
        "errors": errors,
        "error_samples": [e for r in results for e in r["errors"]][:20],
    }


def run(args: argparse.Namespace) -> dict:
    """The soak on ``--root``s, or on a JuiceFS volume mounted for it and unmounted after."""
    if not args.juicefs:
        return soak(args)
    from juicefs_volume import juicefs_volume, unavailable_reason  # tests/, on the path above
    if (reason := unavailable_reason()) is not None:
        raise SystemExit(f"soak: --juicefs: {reason}")
    with juicefs_volume(Path(args.juicefs), clients=3) as volume:
        args.roots = [str(mount / "kv") for mount in volume.mounts]
        return soak(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = run(args)
    ops = summary["operations"]
    print(f"soak {summary['minutes']} min on {summary['machine']}")
    print(f"  stores: {ops.get('store_blocks', 0)} blocks in {ops.get('store_jobs', 0)} jobs "
          f"({format_size(ops.get('store_bytes', 0))}), {ops.get('published', 0)} published")
    print(f"  loads:  {ops.get('load_hits', 0)} hits, {ops.get('load_misses', 0)} misses in {ops.get('load_jobs', 0)} "
          f"jobs ({format_size(ops.get('load_bytes', 0))})")
    if args.evict == "engine":
        sizes = summary["tree_bytes"]
        print(f"  evict:  {ops.get('evict_rounds', 0)} rounds evicted {ops.get('evicted_blocks', 0)} blocks "
              f"({format_size(ops.get('evicted_bytes', 0))}), {ops.get('evict_lease_skips', 0)} lease skips; tree "
              f"{format_size(int(sizes.get('mean', 0)))} on average, at most {format_size(sizes.get('max', 0))} "
              f"({sizes.get('samples', 0)} samples), limit {format_size(summary['settings']['max_size'])}")
    else:
        print(f"  gc:     {ops.get('gc_runs', 0)} runs freed {ops.get('gc_freed_files', 0)} files "
              f"({format_size(ops.get('gc_freed_bytes', 0))}); tree before gc "
              f"{format_size(int(summary['tree_bytes_before_gc'].get('mean', 0)))} on average, limit "
              f"{format_size(summary['settings']['max_size'])}")
    print(f"  fsck:   {ops.get('fsck_runs', 0)} live runs; final: {'clean' if summary['final_fsck']['clean'] else 'PROBLEMS'}"
          f" ({summary['final_fsck']['blocks_checked']} blocks)")
    print(f"  errors: {summary['errors']}")
    for sample in summary["error_samples"]:
        print(f"    {sample}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
