"""The break-even gate: refuses loads whose reusable prefix is shorter than the threshold of
the tier that would serve them (thresholds from a calibration file). Pure; nothing measured."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

from pykv.calibration.file import Calibration, CalibrationError
from pykv.calibration.fit import TIERS

log = logging.getLogger(__name__)


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


def most_reusable(groups: Sequence[tuple[int, Sequence[bytes]]], num_computed_tokens: int) -> int:
    """The most tokens a load could bring beyond ``num_computed_tokens``: ``reusable_prefix``
    when every block hits."""
    if not groups:
        return 0
    end = min(tokens_per_block * len(keys) for tokens_per_block, keys in groups)
    return max(0, end - num_computed_tokens)


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

    def refuses_any_load_of(self, most_tokens: int, tiers: Collection[str] = TIERS) -> bool:
        """Whether every tier of ``tiers`` (those the engine has) would refuse a load of at most
        ``most_tokens`` tokens: then no lookup can change the decision, and a request that short is
        refused without touching the tree."""
        return 0 < most_tokens < min(self.threshold(tier) for tier in tiers)

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
