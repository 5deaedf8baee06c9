"""Bandwidth probes, in their own process (``h200_connector.py bw``): pinned H2D/D2H, the
medium's O_DIRECT reads (``pykv.bench.bench_raw``) and pykv's reactor over real block files
(``pykv.bench.bench_files``)."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from h200bench.util import emit, log


def bw_main(a: argparse.Namespace) -> int:
    tags = {"stage": a.stage, "medium": a.medium}
    if a.h2d:
        probe_h2d(a)
    if a.dir:
        from pykv.bench import bench_raw
        os.makedirs(a.dir, exist_ok=True)
        path = Path(a.dir) / f"pykv-h200-bw-{os.getpid()}.dat"
        try:
            for engine in a.engines.split(","):
                try:
                    runs = bench_raw(engine, path, size=a.size, block_size=a.block, depth=a.depth)
                except Exception as exc:  # noqa: BLE001 - io_uring may be refused (gVisor)
                    emit(a.results, {"kind": "bw", **tags, "what": "odirect_read", "engine": engine,
                                     "error": repr(exc)})
                    continue
                emit_runs(a.results, tags, runs, "odirect_")
            if a.sweep_segments:
                sweep_raw(a, path, tags)
        finally:
            path.unlink(missing_ok=True)
        if a.files:
            probe_files(a, tags)
    return 0


def emit_runs(results: str, tags: dict, runs, prefix: str, suffix: str = "", **extra) -> None:
    """One ``bw`` record per ``pykv.bench`` run."""
    for r in runs:
        emit(results, {"kind": "bw", **tags, "what": f"{prefix}{r.op}{suffix}", "engine": r.engine,
                       "depth": r.depth, "block": r.block_size, "bytes": r.bytes, **extra,
                       "seconds": round(r.seconds, 4), "gb_per_s": round(r.gb_per_s, 3)})


def probe_h2d(a: argparse.Namespace) -> None:
    """Pinned host-to-GPU and GPU-to-host copies of ``--h2d-bytes``, CUDA events, median of ``--reps``."""
    import torch
    if not torch.cuda.is_available():
        log("no CUDA: H2D probe skipped")
        return
    n = a.h2d_bytes
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    for name, src, dst in (("h2d", h, d), ("d2h", d, h)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(a.reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        med = statistics.median(times)
        emit(a.results, {"kind": "bw", "stage": a.stage, "medium": None, "what": name,
                         "bytes": n, "seconds": round(med, 5), "gb_per_s": round(n / med / 1e9, 2), "reps": a.reps})


def probe_files(a: argparse.Namespace, tags: dict) -> None:
    """pykv's reactor loading real block files; with ``--sweep-segments`` also split reads at depth 16/32."""
    from pykv.bench import bench_files
    for depth, segment in [(a.depth, 0)] + [(d, seg) for d in (16, 32) for seg in a.sweep_segments]:
        suffix = f"_seg{segment >> 10}k_d{depth}" if segment else ""
        try:
            runs = bench_files("auto", Path(a.dir), size=a.size, block_size=a.block, depth=depth,
                               read_segment=segment)
            emit_runs(a.results, tags, runs, "files_", suffix, read_segment=segment)
        except Exception as exc:  # noqa: BLE001
            emit(a.results, {"kind": "bw", **tags, "what": f"files_read{suffix}", "error": repr(exc)})


def sweep_raw(a: argparse.Namespace, path: Path, tags: dict) -> None:
    """O_DIRECT reads with smaller requests and deeper queues: the best the medium gives (the
    report's O_DIRECT reference is the maximum over every measured configuration)."""
    from pykv.bench import bench_raw
    for block, depth in ((4 << 20, 16), (4 << 20, 64), (1 << 20, 64), (a.block, 64)):
        for engine in a.engines.split(","):
            try:
                runs = bench_raw(engine, path, size=a.size - a.size % block, block_size=block, depth=depth)
            except Exception as exc:  # noqa: BLE001
                emit(a.results, {"kind": "bw", **tags, "what": "odirect_read_sweep", "engine": engine,
                                 "error": repr(exc)})
                continue
            emit_runs(a.results, tags, runs, "odirect_")
