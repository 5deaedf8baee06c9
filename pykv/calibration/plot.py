"""The calibration's picture: TTFT against the reused prefix per path, break-even marked (PNG)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pykv.io.atomic import write_atomically

if TYPE_CHECKING:
    from pykv.calibration.file import Calibration


def save_plot(calibration: Calibration, path: str | os.PathLike[str]) -> Path:
    """TTFT against prefix length for recomputation, each tier's hits and the gate check's gated runs
    and misses (when measured), break-even marked; PNG."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5), dpi=120)
    recompute: dict[int, float] = {}
    for name, tier in calibration.tiers.items():
        points = sorted(tier.points, key=lambda p: p["tokens"])
        for p in points:
            recompute[p["tokens"]] = p["recompute_s"]
        line, = axes.plot([p["tokens"] for p in points], [p["hit_s"] for p in points], marker="o",
                          label=f"{name} hit")
        threshold = tier.break_even_tokens
        if 0 < threshold < math.inf:
            axes.axvline(threshold, color=line.get_color(), linestyle="--", linewidth=1,
                         label=f"{name} break-even {int(threshold):,} tokens")
    xs = sorted(recompute)
    axes.plot(xs, [recompute[x] for x in xs], marker="s", color="black", label="recompute")
    gated = calibration.details.get("gate_check", {}).get("points", [])
    if gated:
        axes.plot([p["tokens"] for p in gated], [p["gated_s"] for p in gated], marker="^", linestyle=":",
                  color="grey", label="gated (disk, gate on)")
        missed = [p for p in gated if "miss_s" in p]
        if missed:  # the recompute path measured in the gated engine
            axes.plot([p["tokens"] for p in missed], [p["miss_s"] for p in missed], marker="v", linestyle=":",
                      color="silver", label="miss (gated engine)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(xs, [f"{x // 1024}k" if x % 1024 == 0 else str(x) for x in xs])
    axes.minorticks_off()
    axes.set_xlabel("reused prefix (tokens)")
    axes.set_ylabel("TTFT (s, median)")
    axes.set_title(f"{Path(calibration.model).name or calibration.model} on {calibration.gpu or 'unknown device'}",
                   fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    pyplot.close(figure)
    return write_atomically(Path(path), buffer.getvalue())
