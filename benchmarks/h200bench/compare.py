"""Two calibration files side by side: the hit and recompute medians per tier and length, and
whether the second stays within a tolerance of the first (issue 16's re-measure of run 7)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PATHS = ("hit_s", "recompute_s")


def medians(path: str) -> dict[tuple[str, int, str], float]:
    """(tier, tokens, hit_s | recompute_s) -> seconds, from a calibration file's tier points."""
    data = json.loads(Path(path).read_text())
    return {(tier, int(p["tokens"]), what): float(p[what])
            for tier, body in data.get("tiers", {}).items() for p in body.get("points", []) for what in PATHS}


def compare(reference: str, candidate: str, tolerance: float) -> tuple[list[str], bool]:
    """Table lines and whether every point both files measured is within ``tolerance`` (a fraction)."""
    ref, new = medians(reference), medians(candidate)
    lines = [f"{'tier':5} {'tokens':>7} {'what':11} {'reference':>9} {'candidate':>9} {'ratio':>6}"]
    ok = True
    for key in sorted(ref.keys() & new.keys()):
        ratio = new[key] / ref[key] if ref[key] else float("inf")
        within = abs(ratio - 1) <= tolerance
        ok &= within
        tier, tokens, what = key
        lines.append(f"{tier:5} {tokens:>7,} {what:11} {ref[key]:9.3f} {new[key]:9.3f} {ratio:6.3f}"
                     f"{'' if within else '  OUT'}")
    missing = sorted(ref.keys() - new.keys())
    if missing:
        lines.append(f"not measured by the candidate: {missing}")
    return lines, ok and not missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("reference", help="calibration file, e.g. benchmarks/results/calibration-h200-8b-loop-run7.json")
    ap.add_argument("candidate", help="the re-measured calibration file")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest relative difference (default 0.05)")
    a = ap.parse_args(argv)
    lines, ok = compare(a.reference, a.candidate, a.tolerance)
    print("\n".join(lines))
    print(f"every point within {a.tolerance:.0%}: {'yes' if ok else 'no'}")
    return 0 if ok else 1
