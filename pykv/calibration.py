"""Break-even calibration: the calibration file, the fit, and the ``BreakEvenGate``.

A load from pykv is not automatically a win: below some prefix length, vLLM
recomputes the prefix faster than pykv can read it and copy it to the GPU. That
length depends on the model, GPU, medium and tier, so it is measured offline
once per (node, model) by ``pykv calibrate`` (``pykv.connector.calibrate`` runs the
engines) and kept in a small JSON file. At serving time the manager holds a
``BreakEvenGate`` built from that file and refuses loads whose reusable prefix is
shorter than the threshold of the tier that would serve them; vLLM then
recomputes. Nothing is measured or fitted while serving.

The fit: for each measured prefix length L the gain is
``recompute_s(L) - hit_s(L)`` (medians over repetitions; positive = loading wins).
Between measured points the gain is taken as piecewise linear. The break-even
length is the zero crossing of the last segment where the gain goes from
negative to non-negative, i.e. the smallest length from which loading won at
every measured length above it (a noisy early win followed by a loss does not
count). Loading won everywhere: 0 (admit all). Loading lost at the longest
measured length: no threshold (``null`` in the file, refuse every load of that
tier) - nothing was measured that says a longer prefix would win.

This module is pure: it imports neither vLLM nor typer (matplotlib only inside
``save_plot``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from pykv.errors import InputError
from pykv.io.atomic import write_atomically
from pykv.units import parse_size

log = logging.getLogger(__name__)

SCHEMA_KEY = "pykv_calibration"
SCHEMA_VERSION = 1
TIERS = ("disk", "dram")
"""Tiers pykv serves loads from; a disk hit with a DRAM tier on is promoted, but served from disk."""
IDENTITY_FIELDS = ("model", "dtype", "kv_layout")
"""What a calibration must share with the engine that uses it (else the engine refuses to start)."""


class CalibrationError(InputError):
    """A calibration file cannot be used; the message names the file and the field."""

    def __init__(self, source: object, field_name: str, reason: str) -> None:
        super().__init__(f"{source}: {field_name}: {reason}")
        self.source, self.field, self.reason = source, field_name, reason


# -- the fit -----------------------------------------------------------------------------------
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


# -- the file ----------------------------------------------------------------------------------
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


@dataclass
class Calibration:
    """The contents of a calibration file (schema ``pykv_calibration: 1``; docs/calibration.md)."""

    model: str
    dtype: str
    kv_layout: str
    tiers: dict[str, TierCalibration]
    namespace: str | None = None
    gpu: str = ""
    vllm_version: str = ""
    medium: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    """Everything else the file records (method, engine arguments, raw recompute points ...)."""
    created_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return {SCHEMA_KEY: SCHEMA_VERSION, "created_at": self.created_at or _now(), "model": self.model,
                "dtype": self.dtype, "kv_layout": self.kv_layout, "namespace": self.namespace, "gpu": self.gpu,
                "vllm_version": self.vllm_version, "medium": self.medium,
                "tiers": {name: tier.to_json() for name, tier in self.tiers.items()}, **self.details}

    @classmethod
    def from_json(cls, data: Any, source: object = "calibration") -> "Calibration":
        """Validate and read a parsed file; ``CalibrationError`` names ``source`` and the field."""
        if not isinstance(data, dict):
            raise CalibrationError(source, "(top level)", f"expected a JSON object, got {type(data).__name__}")
        version = data.get(SCHEMA_KEY)
        if version is None:
            raise CalibrationError(source, SCHEMA_KEY, "missing: not a pykv calibration file")
        if version != SCHEMA_VERSION:
            raise CalibrationError(source, SCHEMA_KEY, f"version {version!r} is not supported "
                                                       f"(this pykv reads {SCHEMA_VERSION})")
        values = {name: _string(data, name, source) for name in IDENTITY_FIELDS}
        tiers_data = data.get("tiers")
        if not isinstance(tiers_data, dict):
            raise CalibrationError(source, "tiers", "missing or not an object of tiers")
        tiers = {}
        for name, tier in tiers_data.items():
            where = f"tiers.{name}"
            if name not in TIERS:
                raise CalibrationError(source, where, f"unknown tier (known: {', '.join(TIERS)})")
            if not isinstance(tier, dict) or "break_even_tokens" not in tier:
                raise CalibrationError(source, f"{where}.break_even_tokens", "missing")
            threshold = tier["break_even_tokens"]
            if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int)
                                          or threshold < 0):
                raise CalibrationError(source, f"{where}.break_even_tokens",
                                       f"expected a non-negative integer or null, got {threshold!r}")
            points = tier.get("points", [])
            if not isinstance(points, list):
                raise CalibrationError(source, f"{where}.points", "expected a list")
            tiers[name] = TierCalibration(math.inf if threshold is None else threshold, points)
        medium = data.get("medium", {})
        if not isinstance(medium, dict):
            raise CalibrationError(source, "medium", "expected an object")
        namespace = data.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise CalibrationError(source, "namespace", f"expected a string or null, got {namespace!r}")
        known = {SCHEMA_KEY, "created_at", "namespace", "gpu", "vllm_version", "medium", "tiers", *IDENTITY_FIELDS}
        return cls(**values, tiers=tiers, namespace=namespace, gpu=str(data.get("gpu", "")),
                   vllm_version=str(data.get("vllm_version", "")), medium=medium,
                   details={k: v for k, v in data.items() if k not in known},
                   created_at=str(data.get("created_at", "")))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Calibration":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise CalibrationError(path, "(file)", f"cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise CalibrationError(path, "(file)", "not UTF-8 text") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CalibrationError(path, "(file)", f"malformed JSON: {exc}") from None
        return cls.from_json(data, path)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file in the same directory, then rename): never half a file."""
        text = json.dumps(self.to_json(), indent=2) + "\n"
        return write_atomically(Path(path), text.encode())

    def check_engine(self, engine: Mapping[str, str], *, override: bool = False,
                     source: object = "calibration") -> list[str]:
        """Compare model, dtype and KV layout with the engine's; raise on a mismatch unless ``override``.

        Returns the mismatches (as messages) that ``override`` let through.
        """
        mismatches = []
        for name in IDENTITY_FIELDS:
            mine, theirs = getattr(self, name), str(engine[name])
            if mine != theirs:
                reason = (f"calibrated for {mine!r}, this engine has {theirs!r}; run `pykv calibrate` for this "
                          f"engine, or set kv_connector_extra_config.breakeven_override=true to use it anyway")
                if not override:
                    raise CalibrationError(source, name, reason)
                mismatches.append(f"{source}: {name}: {reason}")
        return mismatches

    def thresholds(self) -> dict[str, float]:
        return {name: tier.break_even_tokens for name, tier in self.tiers.items()}


def _string(data: Mapping[str, Any], name: str, source: object) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise CalibrationError(source, name, "missing" if value is None else f"expected a string, got {value!r}")
    return value


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- the gate ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateDecision:
    """What the gate decided for one lookup of one request."""

    admitted: bool
    hit_tokens: int
    tier: str | None


TierOf = Callable[[bytes], "str | None"]
"""Where a key would be loaded from: ``"dram"``, ``"disk"``, or None for a miss."""


def reusable_prefix(groups: Sequence[tuple[int, Sequence[bytes]]], num_computed_tokens: int,
                    tier_of: TierOf) -> tuple[int, str | None]:
    """Tokens a load would bring beyond ``num_computed_tokens``, and the tier that serves them.

    ``groups``: per KV group, (tokens per storage block, the request's block keys in order).
    The prefix is the run of consecutive hits from the block holding token
    ``num_computed_tokens`` on, cut at the shortest group (as vLLM's lookup does).
    Any block from disk makes it a disk load; only DRAM blocks make it a DRAM load.
    """
    end: int | None = None
    found: list[tuple[int, list[str]]] = []
    for tokens_per_block, keys in groups:
        index = num_computed_tokens // tokens_per_block
        tiers: list[str] = []
        while index < len(keys):
            tier = tier_of(keys[index])
            if tier is None:
                break
            tiers.append(tier)
            index += 1
        end = index * tokens_per_block if end is None else min(end, index * tokens_per_block)
        found.append((tokens_per_block, tiers))
    hit = max(0, (end or 0) - num_computed_tokens)
    if not hit:
        return 0, None
    used: set[str] = set()
    for tokens_per_block, tiers in found:
        first = num_computed_tokens // tokens_per_block
        used.update(tiers[:max(0, -(-end // tokens_per_block) - first)])  # blocks below ``end``
    return hit, "disk" if "disk" in used else "dram"


@dataclass(frozen=True)
class BreakEvenGate:
    """Refuses loads shorter than their tier's break-even length. Pure; no measuring.

    ``thresholds``: tier -> tokens (``math.inf``: every load from that tier is
    refused). A tier the calibration did not measure has no threshold: admitted.
    ``margin``: loads are refused up to this fraction above a threshold too (near
    the crossing a load gains nothing on average and carries the medium's spread).
    """

    thresholds: Mapping[str, float]
    margin: float = 0.0

    def threshold(self, tier: str) -> float:
        """The shortest load admitted from ``tier``: its break-even length plus the margin."""
        return self.thresholds.get(tier, 0) * (1 + self.margin)

    def admits(self, hit_tokens: int, tier: str | None) -> bool:
        """Whether loading ``hit_tokens`` tokens from ``tier`` is predicted to beat recomputing them."""
        if hit_tokens <= 0 or tier is None:
            return True
        return hit_tokens >= self.threshold(tier)

    def decide(self, groups: Sequence[tuple[int, Sequence[bytes]]], num_computed_tokens: int,
               tier_of: TierOf) -> GateDecision:
        hit, tier = reusable_prefix(groups, num_computed_tokens, tier_of)
        return GateDecision(self.admits(hit, tier), hit, tier)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], engine: Mapping[str, Any], *, override: bool = False,
                  setting: str | None = None, margin: float = 0.0) -> "BreakEvenGate":
        """The gate of calibration file ``path`` for ``engine`` (its ``model``, ``dtype``, ``kv_layout``).

        Raises ``CalibrationError`` ("<setting>: <path>: <field>: <reason>") for an unreadable
        or malformed file, or one calibrated for another engine unless ``override``
        (then each mismatch is logged as a warning).
        """
        source = f"{setting}: {path}" if setting else str(path)
        try:
            calibration = Calibration.load(path)
            mismatches = calibration.check_engine(engine, override=override, source=path)
        except CalibrationError as exc:
            raise CalibrationError(source, exc.field, exc.reason) from None
        for mismatch in mismatches:
            log.warning("pykv: break-even override: %s", mismatch)
        gate = cls(calibration.thresholds(), margin)
        log.info("pykv: break-even gate from %s: %s (margin %g)", path,
                 {tier: None if math.isinf(t) else int(t) for tier, t in gate.thresholds.items()}, margin)
        return gate


# -- presentation --------------------------------------------------------------------------
def save_plot(calibration: Calibration, path: str | os.PathLike[str]) -> Path:
    """TTFT against prefix length for recomputation, each tier's hits and the gate check's gated runs
    (when measured), break-even marked; PNG."""
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
