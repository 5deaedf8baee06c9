"""Concurrency: two serving processes, two ``gc`` loops and an ``fsck`` loop on one tree at once.

The "engines" are reactors in forked processes storing and loading overlapping keys
(the engine's exact store and load path); gc (with and without its catalog) deletes
blocks they are about to load. Nothing may fail but plain misses, every delivered
block must hold its key's bytes, a concurrent fsck must never see a problem, and a
final gc brings the tree within its limit. With real vLLM engines and ``pykv gc``:
``test_reliability_e2e.py``.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

from pykv.maintenance import fsck, run_gc
from pykv.tree import KVTree

from reliability.rig import NS, Rig, geometry_of, key_of
from reliability.system import collect, spawn

SECONDS = 8.0
KEYS = 300
MIN_BYTES, MAX_BYTES = 4000, 64 * 1024
LIMIT = 2 << 20  # the tree holds far more than this between gcs


def engine(root: str, seed: int) -> dict:
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    errors: list[str] = []
    with Rig(root, create=False, backend="io_uring" if seed % 2 else "threadpool", max_payload=MAX_BYTES,
             keep_payloads=False) as rig:
        deadline = time.monotonic() + SECONDS
        while time.monotonic() < deadline:
            keys = [key_of(rng.randrange(KEYS)) for _ in range(rng.randint(1, 8))]
            geometries = [geometry_of(k, MIN_BYTES, MAX_BYTES) for k in keys]
            if rng.random() < 0.5:
                out = rig.store(keys, geometries)
                counts["stored"] += len(keys)
                counts["published"] += out.result.published
            else:
                out = rig.load(keys, geometries)
                counts["loaded"] += len(out.delivered)
                counts["missed"] += len(out.misses)
                errors += [f"load {rig.path(keys[i]).name}: {reason}" for i, reason in out.errors.items()]
                errors += [f"{rig.path(keys[i]).name}: wrong bytes delivered" for i in out.mismatched]
            if out.result.kind.value == "store":
                errors += [f"store: {reason}" for reason in out.result.failed.values()]
    return {"counts": counts, "errors": errors}


def gc_loop(root: str, use_catalog: bool) -> dict:
    tree = KVTree.open(root)
    counts: Counter[str] = Counter()
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        result = run_gc(tree, LIMIT, min_age_s=0, use_catalog=use_catalog)
        counts["runs"] += 1
        counts["freed"] += result.freed_files
        counts["vanished"] += result.vanished_files
    return {"counts": counts, "errors": []}


def fsck_loop(root: str) -> dict:
    tree = KVTree.open(root)
    counts: Counter[str] = Counter()
    errors = []
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        report = fsck(tree, grace_s=60)  # writers at work have young temps: not problems
        counts["runs"] += 1
        counts["blocks"] += report.blocks_checked
        errors += [f"fsck: {f.path}: {f.problem.value}: {f.detail}" for f in report.findings]
    return {"counts": counts, "errors": errors}


def test_two_writers_two_gcs_and_fsck_at_once(tmp_path):
    root = tmp_path / "tree"
    tree = KVTree.create(root)
    tree.ensure_namespace(NS)
    children = [spawn(engine, str(root), 1), spawn(engine, str(root), 2), spawn(gc_loop, str(root), True),
                spawn(gc_loop, str(root), False), spawn(fsck_loop, str(root))]
    results = [collect(child) for child in children]
    errors = [e for r in results for e in r["errors"]]
    assert errors == []
    (a, b, gc_cat, gc_plain, checker) = (r["counts"] for r in results)
    print("engines:", a, b, "gc:", gc_cat, gc_plain, "fsck:", checker)
    assert a["loaded"] and b["loaded"] and a["missed"] + b["missed"]  # hits and misses both happened
    assert gc_cat["freed"] + gc_plain["freed"] > 0 and checker["runs"] > 0  # gc deleted while they worked

    final = run_gc(tree, LIMIT, min_age_s=0)
    assert final.remaining_bytes <= LIMIT and final.target_reached
    assert fsck(tree, grace_s=0).clean  # and the writers left no temp file
    survivors = [Path(p) for p in map(str, root.rglob("*.kv")) if ".pykv" not in p]
    keys = [bytes.fromhex(p.name[:-3]) for p in survivors]
    with Rig(root, create=False, max_payload=MAX_BYTES) as rig:
        loaded = rig.load(keys, [geometry_of(k, MIN_BYTES, MAX_BYTES) for k in keys])
    assert loaded.result.ok and not loaded.mismatched
