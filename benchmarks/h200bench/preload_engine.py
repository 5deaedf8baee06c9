"""The preloading stages' engine processes (``h200_preload.py burst|turns CONFIG``): one AsyncLLM
engine, a warm-up request, then the burst or the round-robin turns; one JSON record each."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from h200bench.preload_workload import conversation_prompt, loop_read_bytes, summarize, workload
from h200bench.stats import counter_delta, read_stats, worker_counters
from h200bench.util import emit


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
        before = read_stats(cfg.get("stats"))
        gate = asyncio.Semaphore(cfg["concurrency"])
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(r, gate, t0) for r in requests))
        await asyncio.sleep(2.0)  # deferred stores and counters settle
        after = read_stats(cfg.get("stats"))
        return rows, time.perf_counter() - t0, before, after

    rows, wall, before, after = asyncio.run(run())
    wb, wa = worker_counters(before), worker_counters(after)
    sb, sa = before.get("scheduler", {}), after.get("scheduler", {})
    record = {"kind": "burst", "stage": cfg["stage"], "label": cfg["label"], "system": cfg["system"],
              "variant": cfg["variant"], "length": cfg["length"], "requests": cfg["requests"],
              "concurrency": cfg["concurrency"], "docs": cfg["docs"], "start_s": round(start_s, 1),
              "kv_bytes_per_token": cfg.get("kv_bytes_per_token"),
              "wall_s": round(wall, 2), "ttft": summarize(rows), "rows": rows,
              "worker_delta": counter_delta(wb, wa), "scheduler_delta": counter_delta(sb, sa)}
    emit(cfg["results"], record)
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
        before, read_before = read_stats(cfg.get("stats")), loop_read_bytes(cfg.get("loop_dev"))
        t0, rows = time.perf_counter(), []
        for turn in range(cfg["turns"]):
            gate = asyncio.Semaphore(cfg["concurrency"])
            rows += await asyncio.gather(*(one(c, turn, gate) for c in range(cfg["conversations"])))
        wall = time.perf_counter() - t0
        await asyncio.sleep(2.0)  # deferred stores and counters settle
        return rows, wall, before, read_stats(cfg.get("stats")), read_before, loop_read_bytes(cfg.get("loop_dev"))

    rows, wall, before, after, read_before, read_after = asyncio.run(run())
    wb, wa = worker_counters(before), worker_counters(after)
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
    emit(cfg["results"], record)
    engine.shutdown()
    return 0
