"""The report's before/after section: pykv's disk-hit and DRAM-hit TTFT per length for each pykv
source that ran (issue 37: the code before and after a refactor; ``h200_before_after.sh``).

Each record carries ``source`` (a label), ``source_digest`` (of the .py files laid out) and
``source_run`` (one ``h200_run.sh`` command), set by ``h200_run.sh`` (``util.SOURCE_ENV``). A run's
value at a length is the median over its documents of the ``pykv`` ``header`` query engine's
``query`` (disk hit) or ``dram`` (DRAM hit) phase; a source's value is the median over its runs.
The noise is the largest spread between the runs of one source (max / min - 1); a ratio to the
baseline within 1 +- max(noise, ``FLOOR``) is "within noise". The baseline is the source named
``before`` when there is one, else the first to run. ``report.build_report`` appends the section
when the records hold two sources or more; ``h200_connector.py sources FILE...`` prints it alone.
"""

from __future__ import annotations

from h200bench.stats import load_gb_per_s
from h200bench.striping_report import Section
from h200bench.util import expected_chunks

PHASES = (("query", "disk hit"), ("dram", "DRAM hit"))
FLOOR = 0.05
"""The smallest relative difference called beyond noise, whatever the runs' spread."""


def hit_records(records: list[dict]) -> list[dict]:
    """pykv's header-verified query-engine TTFTs that name their source and run."""
    return [r for r in records if r.get("kind") == "ttft" and r.get("system") == "pykv"
            and r.get("variant") == "header" and r.get("phase") in dict(PHASES)
            and r.get("source") and r.get("source_run")]


def sources_in_order(hits: list[dict], baseline: str | None = None) -> list[str]:
    """Every source, the baseline first (``baseline``, else ``before``, else the first to run)."""
    order: list[str] = []
    for r in sorted(hits, key=lambda r: r.get("ts", 0)):
        if r["source"] not in order:
            order.append(r["source"])
    base = baseline if baseline in order else ("before" if "before" in order else (order[0] if order else None))
    return ([base] + [s for s in order if s != base]) if base else order


def verdict(ratio: float | None, noise: float | None) -> str:
    if ratio is None:
        return "—"
    tol = max(noise or 0.0, FLOOR)
    if abs(ratio - 1) <= tol:
        return "within noise"
    return "slower beyond noise" if ratio > 1 else "faster beyond noise"


def build(records: list[dict], baseline: str | None = None, *, always: bool = False) -> Section | None:
    hits = hit_records(records)
    sources = sources_in_order(hits, baseline)
    if len(sources) < 2 and not (always and sources):
        return None
    base = sources[0]
    s = Section.titled(f"Sources side by side: pykv disk-hit and DRAM-hit TTFT, {' / '.join(sources)} "
                       f"(baseline {base})")
    runs = sorted({r["source_run"] for r in hits}, key=lambda run: min(r["ts"] for r in hits if r["source_run"] == run))
    run_source = {run: next(r["source"] for r in hits if r["source_run"] == run) for run in runs}
    for medium in sorted({r.get("medium") or "-" for r in hits}):
        at_medium = [r for r in hits if (r.get("medium") or "-") == medium]
        s.summary[medium] = medium_table(s, at_medium, sources, runs, run_source, medium)
    runs_table(s, records, hits, runs, run_source)
    warn(s, records, hits, runs, run_source)
    return s


def medium_table(s: Section, hits: list[dict], sources: list[str], runs: list[str], run_source: dict,
                 medium: str) -> dict:
    """One row per length and hit kind: each source's runs and median, each ratio to the baseline."""
    from h200bench.report import fmt, median  # the report's helpers (it imports this module)

    base, others = sources[0], sources[1:]
    head = ["length", "hit"]
    for src in sources:
        head += [f"{src} runs", f"{src}"]
    head += [f"{o}/{base}" for o in others] + ["noise", "verdict"]
    rows, summary = [], {}
    for length in sorted({r["length"] for r in hits}):
        for phase, name in PHASES:
            per_run = {run: median([r["ttft"] for r in hits if r["source_run"] == run and r["length"] == length
                                     and r["phase"] == phase]) for run in runs}
            values = {src: [v for run, v in per_run.items() if run_source[run] == src and v is not None]
                      for src in sources}
            medians = {src: median(v) for src, v in values.items()}
            spreads = [max(v) / min(v) - 1 for v in values.values() if len(v) > 1 and min(v) > 0]
            noise = max(spreads) if spreads else None
            ratios = {o: medians[o] / medians[base] if medians[o] and medians[base] else None for o in others}
            row = [f"{length:,}", name]
            for src in sources:
                row += [" / ".join(f"{v:.3f}" for v in values[src]) or "—", fmt(medians[src])]
            row += [fmt(ratios[o], ".3f") for o in others]
            row += [fmt(noise, ".1%") if noise is not None else "one run", " ; ".join(
                verdict(ratios[o], noise) for o in others)]
            rows.append(row)
            summary.setdefault(length, {})[phase] = {"runs": values, "median": medians, "ratio": ratios,
                                                     "noise": noise}
    s.table(f"{medium}: TTFT in seconds (a run: median over its documents; a source: median over its runs)",
            head, rows)
    return summary


def runs_table(s: Section, records: list[dict], hits: list[dict], runs: list[str], run_source: dict) -> None:
    """Each run in order: its source and digest, the medium's O_DIRECT reads, pykv's disk-hit load rate."""
    from h200bench.report import fmt, median

    rows = []
    for run in runs:
        mine = [r for r in records if r.get("source_run") == run]
        odirect = [r["gb_per_s"] for r in mine if r.get("kind") == "bw" and r.get("what") == "odirect_read"
                   and r.get("gb_per_s")]
        disk = [r for r in hits if r["source_run"] == run and r["phase"] == "query"]
        longest = max((r["length"] for r in disk), default=None)
        load = median([load_gb_per_s(r) for r in disk if r["length"] == longest])
        digests = sorted({r.get("source_digest") or "—" for r in mine})
        rows.append([run, run_source[run], ",".join(digests), fmt(max(odirect) if odirect else None, ".2f"),
                     f"{load:.2f} at {longest:,}" if load is not None and longest else "—"])
    s.table("runs in order", ["run", "source", "digest", "O_DIRECT GB/s", "disk-hit load GB/s"], rows)


def warn(s: Section, records: list[dict], hits: list[dict], runs: list[str], run_source: dict) -> None:
    by_source: dict[str, set] = {}
    for r in records:
        if r.get("source") and r.get("source_digest") and r.get("source_run") in run_source:
            by_source.setdefault(r["source"], set()).add(r["source_digest"])
    for src, digests in by_source.items():
        if len(digests) > 1:
            s.warnings.append(f"source {src} ran with different code in different runs (digests {sorted(digests)})")
    for r in hits:
        where = f"{r['source']} run {r['source_run']} L={r['length']} doc {r.get('doc')}"
        if r["phase"] == "query" and r.get("cached") is not None and r["cached"] < r.get("expected_cached", 0):
            s.warnings.append(f"{where}: disk query cached {r['cached']} of {r['expected_cached']} tokens")
        if r["phase"] == "query" and r.get("load_blocks_dram"):
            s.warnings.append(f"{where}: 'disk hit' served {r['load_blocks_dram']} blocks from DRAM")
        if r["phase"] == "dram" and (r.get("load_blocks_disk") or r.get("load_blocks_dram", 0) < expected_chunks(r["length"])):
            s.warnings.append(f"{where}: DRAM query read {r.get('load_blocks_disk')} blocks from disk, "
                              f"{r.get('load_blocks_dram')} from DRAM")
    for r in records:
        if r.get("kind") == "process" and r.get("rc") not in (0, None) and r.get("source_run") in run_source:
            s.warnings.append(f"{r['source']} run {r['source_run']}: {r['label']} exited with rc {r['rc']}")
    counts = {src: sum(1 for run in runs if run_source[run] == src) for src in set(run_source.values())}
    if len(set(counts.values())) > 1:
        s.warnings.append("sources ran unequally often: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


def sources_main(files: list[str], baseline: str | None, md: str | None) -> int:
    """``h200_connector.py sources FILE...``: this section alone (and its warnings), markdown to ``md``."""
    from pathlib import Path

    from h200bench.report import load_records  # the report imports this module

    s = build(load_records(files), baseline, always=True)
    if s is None:
        print("no pykv query TTFTs with a source in", ", ".join(files))
        return 1
    s.lines("warnings:", s.warnings)
    print("\n".join(s.text))
    if md:
        Path(md).write_text("\n".join(s.md) + "\n")
        print(f"markdown: {md}")
    return 0
