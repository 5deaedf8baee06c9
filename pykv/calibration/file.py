"""The calibration file (schema ``pykv_calibration: 1``; docs/calibration.md): reading it
strictly, writing it atomically, and checking it against the engine that would use it."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pykv.calibration.fit import TIERS, TierCalibration
from pykv.errors import InputError
from pykv.io.atomic import write_atomically
from pykv.io.safe_paths import read_small

MAX_FILE_BYTES = 1 << 20
"""A calibration file is a few KiB; a larger one is refused unread."""
SCHEMA_KEY = "pykv_calibration"
SCHEMA_VERSION = 1
IDENTITY_FIELDS = ("model", "dtype", "kv_layout", "codec")
"""What a calibration must share with the engine that uses it (else the engine refuses to start): a codec
changes what a hit costs, so each codec has its calibration (a file without ``codec`` is for ``none``)."""


class CalibrationError(InputError):
    """A calibration file cannot be used; the message names the file and the field."""

    def __init__(self, source: object, field_name: str, reason: str) -> None:
        super().__init__(f"{source}: {field_name}: {reason}")
        self.source, self.field, self.reason = source, field_name, reason


@dataclass
class Calibration:
    """The contents of a calibration file (schema ``pykv_calibration: 1``; docs/calibration.md)."""

    model: str
    dtype: str
    kv_layout: str
    tiers: dict[str, TierCalibration]
    namespace: str | None = None
    codec: str = "none"  # the ``params`` of the codec the calibrated engine stored with
    gpu: str = ""
    vllm_version: str = ""
    medium: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    """Everything else the file records (method, engine arguments, raw recompute points ...)."""
    created_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return {SCHEMA_KEY: SCHEMA_VERSION, "created_at": self.created_at or _now(), "model": self.model,
                "dtype": self.dtype, "kv_layout": self.kv_layout, "codec": self.codec, "namespace": self.namespace,
                "gpu": self.gpu,
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
        values = {name: _string(data, name, source) for name in IDENTITY_FIELDS if name != "codec"}
        values["codec"] = _string(data, "codec", source) if "codec" in data else "none"
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
        try:  # a regular file of at most MAX_FILE_BYTES, opened without blocking (a FIFO, a device: refused)
            text = read_small(path, limit=MAX_FILE_BYTES).decode()
        except OSError as exc:
            raise CalibrationError(path, "(file)", f"cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise CalibrationError(path, "(file)", "not UTF-8 text") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CalibrationError(path, "(file)", f"malformed JSON: {exc}") from None
        except RecursionError:
            raise CalibrationError(path, "(file)", "malformed JSON: nested too deeply") from None
        return cls.from_json(data, path)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file in the same directory, then rename): never half a file."""
        text = json.dumps(self.to_json(), indent=2) + "\n"
        return write_atomically(Path(path), text.encode())

    def check_engine(self, engine: Mapping[str, str], *, override: bool = False,
                     source: object = "calibration") -> list[str]:
        """Compare model, dtype, KV layout and codec with the engine's; raise on a mismatch unless ``override``.

        Returns the mismatches (as messages) that ``override`` let through.
        """
        mismatches = []
        for name in IDENTITY_FIELDS:
            mine, theirs = getattr(self, name), str(engine.get(name, "none") if name == "codec" else engine[name])
            if name == "dtype" and mine == "auto" and theirs in ("bfloat16", "float16"):
                continue  # written where vLLM 26-31 named a model-dtype KV cache "auto"
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
