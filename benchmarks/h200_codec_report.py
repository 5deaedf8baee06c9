"""Issue 38's table from one lease's ``results.jsonl``: disk-hit TTFT per codec beside vLLM's native
fs tier and LMCache, and the ratios the issue's targets name.

One device (stage C per source label, e.g. ``raw``, ``fp8``, ``zst``, ``zgpu`` from
``h200_before_after.sh``; stage D: native fs; stage LM: LMCache in the filling engine and in a fresh
one) and 8 devices (stage S1 with ``--stripe-variant``, the first and second disk hit of each
document). Medians over documents and repeats; every figure from the one file, so from one host.

    python3 benchmarks/h200_codec_report.py benchmarks/results/h200-run19/lease-results.jsonl [--md OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

TARGETS = {"fp8": 1.8, "lossless": 1.3}
STRIPE_TARGETS = {"fp8": 0.40, "lossless": 0.50}


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ttfts(records: list[dict]) -> dict[tuple, list[float]]:
    """(column, phase, length) -> TTFTs, where a column names a system, source and medium."""
    out: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        if r.get("kind") != "ttft":
            continue
        stage, phase, length = r.get("stage"), r.get("phase"), r.get("length")
        if stage == "C" and r.get("system") == "pykv":
            column = f"pykv {r.get('source')}"
        elif stage == "D":
            column = "native fs"
        elif stage == "LM":
            column = f"LMCache {r.get('variant')}"
        elif stage == "S1" and r.get("system") == "pykv":
            column = f"pykv {r.get('variant')} x8"
        else:
            continue
        out[(column, phase, length)].append(r["ttft"])
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def build(records: list[dict]) -> list[str]:
    times = ttfts(records)
    lengths = sorted({k[2] for k in times})
    one = sorted({k[0] for k in times if k[0].startswith("pykv") and not k[0].endswith("x8")})
    eight = sorted({k[0] for k in times if k[0].endswith("x8")})
    peers = [c for c in ("native fs", "LMCache same-engine", "LMCache fresh-engine") if any(k[0] == c for k in times)]
    lines = ["### One loop device: disk-hit TTFT, s (fill, page cache dropped, fresh query engine)", ""]
    cols = peers + one
    lines += ["| length | " + " | ".join(cols) + " | " + " | ".join(f"native ÷ {c}" for c in one) + " |",
              "|---:|" + "---:|" * (len(cols) + len(one))]
    for length in lengths:
        row = {c: median(times.get((c, "query", length), [])) for c in cols}
        native = row.get("native fs")
        ratios = [fmt(native / row[c], 2) + "×" if native and row[c] else "—" for c in one]
        lines.append(f"| {length:,} | " + " | ".join(fmt(row[c]) for c in cols) + " | " + " | ".join(ratios) + " |")
    lines += ["", "DRAM-tier hits of the same engines, s: " + "; ".join(
        f"{c} " + "/".join(fmt(median(times.get((c, 'dram', n), []))) for n in lengths) for c in one), ""]
    if eight:
        lines += ["### 8 loop devices: disk-hit TTFT, s (first and second hit of the document in one engine)", "",
                  "| length | " + " | ".join(eight) + " |", "|---:|" + "---:|" * len(eight)]
        for length in sorted({k[2] for k in times if k[0] in eight}):
            cells = []
            for c in eight:
                values = times.get((c, "query", length), [])
                cells.append(" / ".join(fmt(v) for v in values) or "—")
            lines.append(f"| {length:,} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--md", help="also write the tables to this file")
    args = parser.parse_args()
    text = "\n".join(build(load(args.results)))
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
