"""What ``pykv doctor`` reports: one verdict per item, and the report of a root."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class Verdict(enum.Enum):
    """How one item came out; the order is the severity."""

    OK = "ok"
    SKIP = "skip"
    WARN = "warn"
    FAIL = "fail"


_SEVERITY = {Verdict.OK: 0, Verdict.SKIP: 0, Verdict.WARN: 1, Verdict.FAIL: 2}


@dataclass(frozen=True)
class Diagnosis:
    """One item's verdict and one line why."""

    item: str
    verdict: Verdict
    detail: str


@dataclass(frozen=True)
class DoctorReport:
    """Every item probed on ``root``."""

    root: Path
    diagnoses: tuple[Diagnosis, ...]

    @property
    def verdict(self) -> Verdict:
        """The worst verdict (``OK`` when nothing was worse than skipped)."""
        return max((d.verdict for d in self.diagnoses), key=_SEVERITY.__getitem__, default=Verdict.OK)

    @property
    def failed(self) -> bool:
        return self.verdict is Verdict.FAIL

    def of(self, item: str) -> Diagnosis:
        return next(d for d in self.diagnoses if d.item == item)

    def as_dict(self) -> dict[str, Any]:
        counts = {v.value: sum(d.verdict is v for d in self.diagnoses) for v in Verdict}
        return {"root": str(self.root), "verdict": self.verdict.value, "counts": counts,
                "checks": [{"item": d.item, "verdict": d.verdict.value, "detail": d.detail} for d in self.diagnoses]}
