"""Stage I's engine process (``h200_decode.py itl CONFIG``): one AsyncLLM engine runs long decodes
while a stream of long prompts arrives; the decodes' token arrival times and the long prompts'
TTFT go into one ``itl`` record (the raw arrivals into a file of their own)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from h200bench.decode_workload import decode_prompts, long_stream, stream_window, summarize_decodes
from h200bench.preload_engine import open_engine
from h200bench.preload_workload import summarize
from h200bench.stats import counter_delta, read_stats, worker_counters
from h200bench.util import emit, log


def itl_main(config_path: str) -> int:
    """Warm-up; the decodes start; once every decode has produced ``lead_tokens`` outputs the long
    prompts arrive one every ``long_gap_s``; when the last has its first token, each decode runs
    ``tail_tokens`` more and is aborted (or stops at ``decode_max_tokens``)."""
    cfg, engine, one_token, start_s = open_engine(config_path)
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    vocab = cfg["vocab"]
    decoding = SamplingParams(max_tokens=cfg["decode_max_tokens"], temperature=0.0, ignore_eos=True,
                              detokenize=False, output_kind=RequestOutputKind.DELTA)
    prompts = decode_prompts(cfg["decode_seqs"], cfg["decode_prompt"], vocab)
    stream = long_stream(cfg["long_lengths"], cfg["long_requests"], cfg["docs"], vocab)
    state = {"done_at": None}

    async def decode(i: int, arrivals: list, t0: float) -> dict:
        """One long decode; ``arrivals`` gets (seconds since t0, new tokens) per output."""
        gen = engine.generate({"prompt_token_ids": prompts[i]}, decoding, f"decode{i}")
        tail = 0
        try:
            async for out in gen:
                n = len(out.outputs[0].token_ids) if out.outputs else 0
                if not n:
                    continue
                arrivals.append((round(time.perf_counter() - t0, 5), n))
                if state["done_at"] is not None:
                    tail += n
                    if tail >= cfg["tail_tokens"]:
                        break  # aclose() aborts the request
        finally:
            await gen.aclose()
        tokens = sum(n for _, n in arrivals)
        return {"id": f"decode{i}", "tokens": tokens, "capped": tokens >= cfg["decode_max_tokens"]}

    async def long(request: dict, t0: float) -> dict:
        submitted, first, cached = time.perf_counter(), None, None
        async for out in engine.generate({"prompt_token_ids": request["tokens"]}, one_token, request["id"]):
            if first is None and out.outputs and out.outputs[0].token_ids:
                first, cached = time.perf_counter(), getattr(out, "num_cached_tokens", None)
        return {"id": request["id"], "hit": request["hit"], "length": request["length"],
                "submitted": round(submitted - t0, 4), "ttft": round((first or time.perf_counter()) - submitted, 4),
                "cached": cached}

    async def lead(arrivals: list[list]) -> None:
        """Until every decode has ``lead_tokens`` outputs (or ``lead_timeout_s`` passed)."""
        deadline = time.perf_counter() + cfg["lead_timeout_s"]
        while not all(len(a) >= cfg["lead_tokens"] for a in arrivals):
            if time.perf_counter() > deadline:
                log(f"lead: not every decode reached {cfg['lead_tokens']} outputs in {cfg['lead_timeout_s']} s")
                return
            await asyncio.sleep(0.005)

    async def run() -> tuple:
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
        async for _ in engine.generate({"prompt_token_ids": [1] * 1024}, warm, "warmup"):
            pass
        await asyncio.sleep(1.0)
        before = read_stats(cfg.get("stats"))
        arrivals: list[list] = [[] for _ in prompts]
        t0 = time.perf_counter()
        decodes = [asyncio.create_task(decode(i, arrivals[i], t0)) for i in range(len(prompts))]
        await lead(arrivals)
        started = time.perf_counter() - t0
        longs = []
        for i, request in enumerate(stream):
            wait = started + i * cfg["long_gap_s"] - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            longs.append(asyncio.create_task(long(request, t0)))
        long_rows = await asyncio.gather(*longs)
        state["done_at"] = time.perf_counter() - t0
        decode_rows = await asyncio.gather(*decodes)
        wall = time.perf_counter() - t0
        await asyncio.sleep(2.0)  # deferred stores and counters settle
        for row, a in zip(decode_rows, arrivals):
            row["arrivals"] = a
        return decode_rows, list(long_rows), wall, before, read_stats(cfg.get("stats"))

    decode_rows, long_rows, wall, before, after = asyncio.run(run())
    window = stream_window(long_rows)
    if cfg.get("raw"):
        Path(cfg["raw"]).write_text(json.dumps({"label": cfg["label"], "window": window, "decodes": decode_rows,
                                                "longs": long_rows}))
    wb, wa = worker_counters(before), worker_counters(after)
    sb, sa = before.get("scheduler", {}), after.get("scheduler", {})
    record = {"kind": "itl", "stage": cfg["stage"], "label": cfg["label"], "system": cfg["system"],
              "decode_seqs": cfg["decode_seqs"], "decode_prompt": cfg["decode_prompt"],
              "long_lengths": cfg["long_lengths"], "long_requests": cfg["long_requests"],
              "long_gap_s": cfg["long_gap_s"], "docs": cfg["docs"], "start_s": round(start_s, 1),
              "wall_s": round(wall, 2), "window": [round(x, 4) for x in window] if window else None,
              "itl": summarize_decodes(decode_rows, window), "ttft": summarize(long_rows),
              "decodes": [{k: d[k] for k in ("id", "tokens", "capped")} for d in decode_rows], "longs": long_rows,
              "worker_delta": counter_delta(wb, wa), "scheduler_delta": counter_delta(sb, sa)}
    emit(cfg["results"], record)
    engine.shutdown()
    return 0
