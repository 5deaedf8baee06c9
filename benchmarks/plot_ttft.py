"""TTFT against prompt length on the H200 host: docs/img/ttft-vs-length.svg.

Reads the figures extracted from the committed run records,
``benchmarks/results/ttft-vs-length.csv`` (one row per measured point, each naming its run,
machine and source file), and draws one line per series through the points that were measured;
nothing is interpolated or fitted. Needs matplotlib.

    python benchmarks/plot_ttft.py [--csv PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CSV = REPO / "benchmarks" / "results" / "ttft-vs-length.csv"
OUT = REPO / "docs" / "img" / "ttft-vs-length.svg"

#: Drawing order and style per series; a series the CSV has and this lacks is drawn plain.
STYLES = {
    "recompute": dict(color="#555555", marker="o", linestyle="-"),
    "native fs tier": dict(color="#d62728", marker="s", linestyle="-"),
    "pykv 1 device": dict(color="#1f77b4", marker="^", linestyle="-"),
    "pykv 8 devices": dict(color="#2ca02c", marker="D", linestyle="-"),
    "pykv 8 devices (calibration)": dict(color="#2ca02c", marker=".", linestyle=":"),
}
LABELS = {
    "recompute": "recompute (vLLM, no connector)",
    "native fs tier": "vLLM native fs tier, 1 device (best of 4/16/64 threads)",
    "pykv 1 device": "pykv, 1 device",
    "pykv 8 devices": "pykv, 8 devices",
    "pykv 8 devices (calibration)": "pykv, 8 devices (pykv calibrate's disk engine)",
}


def read_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Series name -> [(tokens, TTFT seconds)] sorted by tokens, from the CSV."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            series[row["series"]].append((int(row["tokens"]), float(row["ttft_s"])))
    return {name: sorted(points) for name, points in series.items()}


def plot(series: dict[str, list[tuple[int, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    plt.rcParams["svg.hashsalt"] = "pykv-ttft"  # stable ids: the same CSV gives the same file
    plt.rcParams["svg.fonttype"] = "none"  # text as text, not glyph paths
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    order = [name for name in STYLES if name in series] + sorted(set(series) - set(STYLES))
    for name in order:
        tokens, seconds = zip(*series[name])
        ax.plot(tokens, seconds, label=LABELS.get(name, name), linewidth=1.6, markersize=6,
                **STYLES.get(name, {}))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lengths = sorted({t for points in series.values() for t, _ in points})
    ax.xaxis.set_major_locator(FixedLocator(lengths))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda t, _: f"{int(t) // 1024}k"))
    ax.yaxis.set_major_locator(FixedLocator([0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda s, _: f"{s:g}"))
    ax.set_xlabel("prompt length (tokens reused from the cache)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Llama-3.2-3B shape on one H200, vLLM 0.26; run 18, machine D", fontsize=10)
    ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, default=CSV, help="measured points (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help="SVG to write (default: %(default)s)")
    args = parser.parse_args()
    plot(read_points(args.csv), args.out)
    print(args.out)


if __name__ == "__main__":
    main()
