"""The break-even fit: measured points, the zero crossing of the gain, a tier's threshold, and the
parsing of the lengths and tiers to measure (the rule: the package docstring)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from pykv.errors import InputError
from pykv.units import parse_size

TIERS = ("disk", "dram")
"""Tiers pykv serves loads from; a disk hit with a DRAM tier on is promoted, but served from disk."""


@dataclass(frozen=True)
class Point:
    """One measured prefix length: median TTFTs of recomputing it and of loading it."""

    tokens: int
    recompute_s: float
    hit_s: float

    @property
    def gain_s(self) -> float:
        """Seconds saved by loading instead of recomputing (negative: loading loses)."""
        return self.recompute_s - self.hit_s


def median(values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def break_even_tokens(points: Sequence[Point]) -> float:
    """The prefix length from which loading beats recomputing: 0, a positive int, or ``math.inf``.

    See the module docstring for the rule (piecewise linear gain, last crossing
    from negative to non-negative).
    """
    if not points:
        raise ValueError("no measured points")
    ordered = sorted(points, key=lambda p: p.tokens)
    losing = [i for i, p in enumerate(ordered) if p.gain_s < 0]
    if not losing:
        return 0
    last = losing[-1]
    if last == len(ordered) - 1:
        return math.inf
    below, above = ordered[last], ordered[last + 1]
    fraction = -below.gain_s / (above.gain_s - below.gain_s)
    return math.ceil(below.tokens + fraction * (above.tokens - below.tokens))


@dataclass
class TierCalibration:
    """One tier: its threshold (``math.inf`` = loading never won) and the points behind it."""

    break_even_tokens: float
    points: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def fit(cls, points: Sequence[Point], raw: Sequence[Mapping[str, Any]] = ()) -> "TierCalibration":
        """Threshold from ``points``; ``raw[i]`` (samples, counters) is kept beside point i."""
        extras = list(raw) or [{} for _ in points]
        rows = [{"tokens": p.tokens, "recompute_s": round(p.recompute_s, 6), "hit_s": round(p.hit_s, 6),
                 "gain_s": round(p.gain_s, 6), **dict(extra)} for p, extra in zip(points, extras)]
        return cls(break_even_tokens(points), rows)

    def to_json(self) -> dict[str, Any]:
        threshold = None if math.isinf(self.break_even_tokens) else int(self.break_even_tokens)
        return {"break_even_tokens": threshold, "points": self.points}


def fit_tiers(samples: Iterable[Mapping[str, Any]], tiers: Sequence[str]
              ) -> tuple[dict[str, TierCalibration], list[dict[str, Any]], list[dict[str, Any]]]:
    """Fit each tier from raw samples ``{"path", "tokens", "seconds"}``; path is ``recompute``,
    ``cold`` or a tier. Returns (tiers, recompute points, cold points), medians per length."""
    grouped: dict[tuple[str, int], list[float]] = {}
    for sample in samples:
        grouped.setdefault((sample["path"], int(sample["tokens"])), []).append(float(sample["seconds"]))

    def series(path: str) -> list[dict[str, Any]]:
        return [{"tokens": n, "seconds": round(median(v), 6), "samples": v}
                for (p, n), v in sorted(grouped.items()) if p == path]

    recompute = {row["tokens"]: row["seconds"] for row in series("recompute")}
    fitted = {}
    for tier in tiers:
        rows = [row for row in series(tier) if row["tokens"] in recompute]
        if not rows:
            raise ValueError(f"no {tier} samples at a length that was also recomputed")
        points = [Point(row["tokens"], recompute[row["tokens"]], row["seconds"]) for row in rows]
        fitted[tier] = TierCalibration.fit(points, [{"hit_samples": row["samples"]} for row in rows])
    return fitted, series("recompute"), series("cold")


def parse_lengths(text: str, *, multiple: int = 1, field_name: str = "--lengths") -> list[int]:
    """Token counts from ``"1k,2k,80k"`` (binary: 1k = 1024), each a positive multiple of ``multiple``."""
    lengths: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            raise InputError(f"{field_name}: empty entry in {text!r}")
        value = parse_size(part, field=field_name)
        if value <= 0 or value % multiple:
            raise InputError(f"{field_name}: {part} = {value} tokens is not a positive multiple of the "
                             f"storage block ({multiple} tokens)")
        lengths.append(value)
    if len(set(lengths)) != len(lengths):
        raise InputError(f"{field_name}: repeated length in {text!r}")
    return sorted(lengths)


def parse_tiers(text: str, *, field_name: str = "--tiers") -> list[str]:
    tiers = [t.strip() for t in str(text).split(",") if t.strip()]
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        raise InputError(f"{field_name}: expected a list of {', '.join(TIERS)}, got {text!r}")
    return list(dict.fromkeys(tiers))
