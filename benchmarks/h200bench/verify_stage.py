"""Stage S5 (issue 17): what ``verify=full`` and the I/O engine cost a load over the device set. The reactor alone over block files on all devices (``multibw --files-only``: ``verify=header``
once, ``verify=full`` per ``VERIFY_THREADS``), then one fill engine with ``pykv config``'s defaults
and a fresh query engine per variant of ``QUERIES`` (page cache dropped before each): the same
tree loaded with each hashing setting, so the variants differ in the load path alone."""

from __future__ import annotations

import os
import sys

from h200bench import striping
from h200bench.runner import ENTRY
from h200bench.striping_report import Section

VERIFY_THREADS = (8,)
DEPTHS = (4, 8, 16)
"""The reactor pass: ``verify=full`` with the 8 hashing threads auto gives 8 devices (runs 13-14 tried
4-16), at each of these reads in flight per device (the default ``io_depth`` is 16)."""
QUERIES = [("defaults", {}), ("depth4", {"io_depth": 4}), ("repeat", {}), ("depth8", {"io_depth": 8}),
           ("threadpool", {"io_engine": "threadpool"}), ("header", {"verify": "header"}),
           ("vt4", {"verify_threads": 4})]
"""(variant, keys added to the defaults) of the query engines after S5's one fill: the defaults
(``io_depth`` 16, ``verify_threads`` auto), 4 reads in flight per device, the defaults again (the
spread between engines of one configuration: 0.55-0.82 s at 80k in run 15), 8 reads in flight, the
thread pool, no checksum, run 13's default of 4 hashing threads. (Run 17 also tried ``scatter_slots``,
out-of-order loads through a device scratch: slower, removed; benchmarks/results/history/31-run-17-scatter-ceiling.md.)"""


def stage_s5(runner) -> None:
    runner.phase_env()
    mnts = striping.devices(runner)
    try:
        striping.clear(runner, mnts)
        reactor_pass(runner, mnts)
        striping.clear(runner, mnts)
        striping.pykv_disk_hits(runner, mnts, queries=chosen_queries(runner.a.s5_queries))
    finally:
        striping.finish(runner, mnts)


def chosen_queries(names: str) -> list[tuple[str, dict]]:
    """The variants of ``QUERIES`` named in ``names`` (comma separated; empty: all), in its order."""
    if not names:
        return QUERIES
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    unknown = wanted - {name for name, _ in QUERIES}
    if unknown:
        raise SystemExit(f"--s5-queries: unknown variant(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(name for name, _ in QUERIES)}")
    return [(name, keys) for name, keys in QUERIES if name in wanted]


def reactor_pass(runner, mnts: list[str]) -> None:
    dirs = [os.path.join(m, "bw") for m in mnts]
    size = (56 << 20) if runner.smoke else (1 << 30)
    argv = [sys.executable, str(ENTRY), "mbw", "--results", str(runner.results), "--stage", runner.stage,
            "--dirs", ",".join(dirs), "--files-only", "--engines", "io_uring", "--files-modes", "header,full",
            "--verify-threads", ",".join(str(t) for t in VERIFY_THREADS), "--files-size", str(size),
            "--files-depth", ",".join(str(d) for d in DEPTHS)]
    if runner.dry:
        print(f"  reactor over block files on {len(dirs)} devices: verify=header, verify=full with "
              f"{'/'.join(str(t) for t in VERIFY_THREADS)} hashing threads, at depth {'/'.join(str(d) for d in DEPTHS)}")
        return
    runner.spawn("mbw-verify", argv, 180)


def build(records: list[dict]) -> Section | None:
    """The report's section: S5's disk hits per query variant (None when S5 has not run)."""
    from h200bench.auth_stage import fmt_rates, load_rates
    from h200bench.report import median
    from h200bench.striping_report import reactor_lines

    ttft = [r for r in records if r.get("kind") == "ttft" and r.get("phase") == "query"
            and r.get("system") == "pykv" and r.get("stage") == "S5"]
    if not ttft:
        return None
    s = Section.titled("Issue 17: verify=full, hashing threads and the I/O engine, the device set (stage S5)")
    s5 = [r for r in records if r.get("stage") == "S5"]
    s.lines("the reactor over block files (no GPU):", reactor_lines(s5, {}))
    lines = []
    variants = list(dict.fromkeys(["defaults"] + [r.get("variant") for r in ttft]))  # as run, any lease's
    for length in sorted({r["length"] for r in ttft}):
        parts = []
        for variant in variants:
            hit = median([r["ttft"] for r in ttft if r["length"] == length and r.get("variant") == variant])
            rates = load_rates(ttft, length, variant)
            if hit is not None:
                parts.append(f"{variant} {hit:.3f} s" + (f" (load {fmt_rates(rates)} GB/s)" if rates else ""))
        lines.append(f"L={length:,}: " + ", ".join(parts))
    s.lines("disk-hit TTFT per query variant (medians):", lines)
    order = block_order_lines(ttft, variants)
    if order:
        s.lines("each engine's first and second load of a length (GPU blocks ascending, then the ones "
                "the first freed; copy entries per storage block):", order)
    s.summary = {"lines": lines}
    return s


def block_order_lines(ttft: list[dict], variants: list[str]) -> list[str]:
    """Per length and variant, the engines' first loads of the length against their second ones
    (TTFT, medians over engines, and the copy entries per storage block the worker counted): vLLM
    hands the second load the blocks the first freed, in descending order (run 16)."""
    from h200bench.report import median

    seen: dict[tuple[str, int], int] = {}
    turns: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for r in ttft:  # records in the order the engine ran them
        blocks = r.get("worker_delta", {}).get("delivered_blocks") or r.get("load_blocks_disk")
        entries = r.get("worker_delta", {}).get("h2d_entries")
        if not blocks or entries is None:
            continue
        turn = seen[(r["label"], r["length"])] = seen.get((r["label"], r["length"]), 0) + 1
        turns.setdefault((r["length"], r.get("variant"), min(turn, 2)), []).append((r["ttft"], entries / blocks))
    lines = []
    for length in sorted({key[0] for key in turns}):
        parts = []
        for variant in variants:
            cells = []
            for turn in (1, 2):
                got = turns.get((length, variant, turn))
                if got:
                    cells.append(f"{median([t for t, _ in got]):.3f} s ({median([e for _, e in got]):.0f})")
            if cells:
                parts.append(f"{variant} " + " / ".join(cells))
        lines.append(f"L={length:,}: " + ", ".join(parts))
    return lines
