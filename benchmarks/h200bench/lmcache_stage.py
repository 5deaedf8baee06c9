"""Stage LM (issue 38): LMCache 0.5.3's ``local_disk`` backend in vLLM 0.26, the peer users would pick,
on a fresh loop device like stage D's, with stage C/D's documents (``--loop-docs`` per length).

One engine fills every document (LMCache writes each 256-token chunk as one ``.pt`` file), waits for
the files, drops the page cache and queries each document again in the same engine; a fresh engine
over the same tree then queries them once more. LMCache keeps its local_disk index in the engine's
memory, so the fresh engine is expected to hit nothing: the report says what each engine cached.

LMCache is not on the host's image: its wheel and the three the image lacks (``aiofile``, ``caio``,
``uvicorn``) are carried in ``.device/lmcache`` (``--lmcache-wheels``) and installed once per lease,
``--no-deps``, into ``WORK/lmcache-site``, which only LMCache's engines get on their PYTHONPATH.
LMCache's own settings go to a YAML file named by ``LMCACHE_CONFIG_FILE`` (benchmarks/README.md,
"H200: LMCache beside pykv").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from h200bench.loop import image_bytes
from h200bench.settings import CHUNK, GIB, REPO, WARMUP_TOKENS
from h200bench.striping_report import Section
from h200bench.util import count_files, drop_caches, log, tree_bytes

VERSION = "0.5.3"
"""The LMCache release that loads on the host's torch 2.11 (0.5.5 and 0.5.6 miss a c10 symbol)."""
WHEELS_DIR = REPO / ".device" / "lmcache"
"""``--lmcache-wheels`` default: where the device command carries the wheels."""
MEDIUM = "loop"
SYSTEM = "lmcache"
SAME, FRESH = "same-engine", "fresh-engine"
"""The query engines' variants: the engine that filled (its index in memory), and a new one."""
KTC = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
#: seconds a part needs on the H200 (estimates: an engine starts in 15-50 s, LMCache pins its CPU
#: buffer first; the fill stores 14 GB): a part starts only with this much left before the deadline;
#: a hung engine is killed 100 s (fill) or 80 s (fresh) after that
FILL_ENGINE_S = 200
FRESH_ENGINE_S = 100


def cpu_gib(runner) -> float:
    """LMCache's ``max_local_cpu_size``: it stages a whole request in CPU memory before it reads or
    writes, so twice the largest document's KV and 2 GiB (20 GiB at 80k tokens for the 3B shape, what
    held an 80k request on the H200; its default, 5, does not)."""
    if runner.a.lmcache_cpu_gib:
        return float(runner.a.lmcache_cpu_gib)
    largest = max(runner.lengths) * runner.info()["kv_bytes_per_token"]
    return float(max(5, math.ceil(2 * largest / GIB) + 2))


def lmcache_config(runner, root: str, disk_gib: int) -> dict:
    """LMCache 0.5.3's settings (keys of ``lmcache/v1/config.py``): no CPU tier of its own (its CPU
    buffer only stages), ``local_disk`` on the loop device, 256-token chunks like every other system
    here; everything else at LMCache's defaults (buffered file I/O, no O_DIRECT)."""
    return {"chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": cpu_gib(runner),
            "local_disk": f"file://{os.path.abspath(root)}/", "max_local_disk_size": float(disk_gib)}


def expected_files(runner) -> int:
    """Chunk files a fill of stage C/D's documents writes (full chunks, and the warm-up's)."""
    return sum(length // CHUNK for length in runner.lengths) * runner.loop_docs + WARMUP_TOKENS // CHUNK


def install(wheels: Path, target: Path) -> bool:
    """The carried wheels into ``target`` (``--no-deps``, nothing from an index), unless LMCache is
    there already (an earlier command of this lease). False when there is nothing to install from or
    pip failed."""
    if (target / "lmcache").is_dir():
        log(f"LMCache: already in {target}")
        return True
    found = sorted(str(w) for w in wheels.glob("*.whl")) if wheels.is_dir() else []
    if not any(Path(w).name.startswith(f"lmcache-{VERSION}-") for w in found):
        log(f"LMCache: no lmcache-{VERSION} wheel in {wheels} (carry .device/lmcache: benchmarks/README.md)")
        return False
    log(f"LMCache: installing {len(found)} wheels from {wheels} into {target}")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                             "--no-compile", "-t", str(target), *found], capture_output=True, text=True)
    if result.returncode != 0:
        log(f"LMCache: pip failed: {result.stderr.strip()[-500:]}")
        return False
    return True


@contextmanager
def lmcache_env(runner, site: Path, config_file: Path) -> Iterator[None]:
    """The engines spawned inside get LMCache's site (after everything else on PYTHONPATH, so it
    shadows nothing) and its config file."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(site)]
    runner.extra_env = {"PYTHONPATH": os.pathsep.join(path), "LMCACHE_CONFIG_FILE": str(config_file),
                        "LMCACHE_TRACK_USAGE": "false"}
    try:
        yield
    finally:
        runner.extra_env = {}


def import_check(runner) -> dict:
    """LMCache's version and its vLLM adapter imported in a child with the engines' environment."""
    code = ("import importlib.metadata as m, vllm; "
            "from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl; "
            "print(m.version('lmcache'), vllm.__version__)")
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=runner.env(),
                                cwd=runner.work, timeout=120)
    except subprocess.TimeoutExpired:
        return {"ok": False, "versions": "import check: no answer in 120 s"}
    ok = result.returncode == 0
    return {"ok": ok, "versions": result.stdout.strip() if ok else result.stderr.strip()[-600:]}


def skip(runner, label: str, why: str) -> None:
    log(f"{label}: skipped ({why})")
    runner.record({"kind": "skipped", "stage": runner.stage, "label": label, "why": why})


def ready(runner, site: Path) -> bool:
    """LMCache installed into ``site`` and importable beside vLLM (an ``env`` record says which
    versions), inside ``lmcache_env``; False (and the stage failed) when it is not."""
    wheels = Path(runner.a.lmcache_wheels)
    if runner.dry:
        print(f"  lmcache: wheels {wheels} -> {site} (pip --no-deps, once per lease), import check")
        return True
    if not install(wheels, site):
        skip(runner, "lmcache-loop", "LMCache not installed")
        runner.failed = True
        return False
    check = import_check(runner)
    runner.record({"kind": "env", "stage": runner.stage, "what": "lmcache", **check})
    if not check["ok"]:
        log(f"LMCache: import check failed: {check['versions']}")
        runner.failed = True
        return False
    log(f"LMCache: lmcache and vllm {check['versions']}")
    return True


def stage_lm(runner) -> None:
    if runner.smoke:
        log("stage LM: skipped in --cpu-smoke (LMCache's kernels need CUDA)")
        return
    site, config_file = runner.work / "lmcache-site", runner.work / "cfg" / "lmcache-loop.yaml"
    with lmcache_env(runner, site, config_file):
        if not ready(runner, site):
            return
        if not runner.dry and runner.remaining() < FILL_ENGINE_S + FRESH_ENGINE_S:
            skip(runner, "lmcache-loop", f"time: {runner.remaining():.0f} s left")
            return
        size = image_bytes(tree_bytes(runner.lengths, runner.loop_docs, runner.info()["kv_bytes_per_token"]))
        mnt = runner.loop_setup("lmcache", size)
        try:
            engines(runner, os.path.join(mnt, "lmcache"), size // GIB - 1, config_file)
        finally:
            if not runner.dry:
                runner.loops.teardown_all()


def engines(runner, root: str, disk_gib: int, config_file: Path) -> None:
    """The fill engine (fill, files written, page cache dropped, query), then a fresh query engine."""
    config = lmcache_config(runner, root, disk_gib)
    expected = expected_files(runner)
    if runner.dry:
        print(f"    LMCACHE_CONFIG_FILE {config_file}: {json.dumps(config)}")
    else:
        config_file.write_text(json.dumps(config, indent=1) + "\n")  # JSON is YAML
        runner.record({"kind": "env", "stage": runner.stage, "what": "lmcache_config", "config": config})
    fill = runner.engine("lmcache-loop", system=SYSTEM, medium=MEDIUM, variant=SAME,
                         steps=[{"op": "fill"},
                                {"op": "settle", "files_root": root, "files_suffix": ".pt",
                                 "files_expected": expected, "timeout": 240},
                                {"op": "settle", "seconds": 3.0},  # the last file is written, then indexed
                                {"op": "drop_caches"},
                                {"op": "query", "phases": ["query"]}],
                         ktc=KTC, docs=runner.loop_docs, timeout=FILL_ENGINE_S + 100)
    if not runner.dry:
        runner.record({"kind": "tree", "stage": runner.stage, "medium": MEDIUM, "root": root,
                       "system": SYSTEM, "files": count_files(root, ".pt"), "files_expected": expected})
    if fill != 0:
        log("LMCache: the fill engine failed; fresh engine skipped")
        return
    if not runner.dry and runner.remaining() < FRESH_ENGINE_S:
        skip(runner, "lmcache-loop-fresh", f"time: {runner.remaining():.0f} s left")
        return
    if not runner.dry:
        runner.record({"kind": "drop_caches", "stage": runner.stage, "ok": drop_caches()})
    runner.engine("lmcache-loop-fresh", system=SYSTEM, medium=MEDIUM, variant=FRESH,
                  steps=[{"op": "query", "phases": ["query"]}], ktc=KTC, docs=runner.loop_docs,
                  timeout=FRESH_ENGINE_S + 80)


# -- the report -----------------------------------------------------------------------------------------
def build(records: list[dict]) -> Section | None:
    """LMCache's hits per length beside pykv's disk hit and the native fs tier on the loop device (None
    when stage LM has not run)."""
    from h200bench.report import fmt, latest_run, median  # the report imports this module

    ttft = [r for r in records if r.get("kind") == "ttft"]
    if not any(r.get("system") == SYSTEM for r in ttft):
        return None
    s = Section.titled(f"Issue 38: LMCache {VERSION} (local_disk) beside pykv and the native fs tier, loop device "
                       "(stage LM)")

    def of(length: int, phase: str = "query", **match) -> tuple[float | None, list[dict]]:
        rows = [r for r in latest_run(ttft, phase=phase, **match) if r["length"] == length]
        return median([r["ttft"] for r in rows]), rows

    def cached(rows: list[dict]) -> str:
        return "/".join(str(r.get("cached")) for r in rows) if rows else "—"

    head = ["length", "LMCache fill", "LMCache same engine", "cached", "GB/s", "LMCache fresh engine", "cached",
            "pykv disk hit", "native fs", "LMCache/pykv", "LMCache/native fs"]
    rows, summary = [], {}
    lengths = sorted({r["length"] for r in ttft if r.get("system") == SYSTEM})
    for length in lengths:
        fill, _ = of(length, "fill", system=SYSTEM, medium=MEDIUM, variant=SAME)
        same, same_rows = of(length, system=SYSTEM, medium=MEDIUM, variant=SAME)
        fresh, fresh_rows = of(length, system=SYSTEM, medium=MEDIUM, variant=FRESH)
        pykv, _ = of(length, system="pykv", medium=MEDIUM, variant="header")
        nfs, _ = of(length, system="native_fs", medium=MEDIUM)
        rate = median([r.get("e2e_gb_per_s") for r in same_rows])
        vs_pykv = same / pykv if same and pykv else None
        vs_fs = same / nfs if same and nfs else None
        rows.append([f"{length:,}", fmt(fill), fmt(same), cached(same_rows), fmt(rate, ".2f"), fmt(fresh),
                     cached(fresh_rows), fmt(pykv), fmt(nfs), fmt(vs_pykv, ".2f"), fmt(vs_fs, ".2f")])
        summary[length] = {"fill": fill, "same_engine": same, "fresh_engine": fresh, "pykv_disk": pykv,
                           "native_fs": nfs, "same_vs_pykv": vs_pykv, "same_vs_native_fs": vs_fs,
                           "fresh_cached": [r.get("cached") for r in fresh_rows]}
        for r in same_rows:
            if r.get("cached") is not None and r["cached"] < r.get("expected_cached", 0):
                s.warnings.append(f"LMCache same engine L={length:,} doc {r['doc']}: cached {r['cached']} of "
                                  f"{r['expected_cached']} tokens (partial hit)")
        for r in fresh_rows:
            if r.get("cached"):
                s.warnings.append(f"LMCache fresh engine L={length:,} doc {r['doc']}: cached {r['cached']} tokens "
                                  "(its index was thought to live in the engine only)")
    s.table("TTFT in seconds (median over documents); cached tokens per document; GB/s: cached KV bytes / TTFT",
            head, rows)
    s.lines("protocol:", [
        "same engine: fill, chunk files written, page cache dropped, query (LMCache's index is in this engine)",
        "fresh engine: a new engine over the same tree, page cache dropped: LMCache keeps its local_disk "
        "index in memory, so a restart finds nothing (pykv and the native fs tier query in a fresh engine)",
        "pykv disk hit: stage C; native fs: stage D (both a fresh engine after the fill, page cache dropped)"])
    s.summary = {"lengths": summary}
    return s
