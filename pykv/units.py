"""Parsing of human-written sizes, durations and integer lists (``28M``, ``10m``, ``1,4,16``)."""

from __future__ import annotations

import re

from pykv.errors import InputError

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_size(text: str | int, *, field: str = "size") -> int:
    """Bytes from ``"500G"``, ``"28M"``, ``"4096"`` or ``"1.5GiB"`` (binary units)."""
    if isinstance(text, int):
        if text < 0:
            raise InputError(f"{field}: must not be negative, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise InputError(f"{field}: cannot parse size {text!r} (examples: 4096, 28M, 500G)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.upper()])


def parse_duration(text: str | float, *, field: str = "duration") -> float:
    """Seconds from ``"10m"``, ``"30s"``, ``"2h"``, ``"1d"`` or a plain number of seconds."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise InputError(f"{field}: must not be negative, got {text}")
        return float(text)
    match = _DURATION_RE.match(str(text))
    if not match:
        raise InputError(f"{field}: cannot parse duration {text!r} (examples: 30s, 10m, 2h, 1d)")
    number, unit = match.groups()
    return float(number) * _DURATION_UNITS[unit]


def parse_int_list(text: str, *, field: str = "list", minimum: int = 1) -> list[int]:
    """Integers from ``"1,4,16,64"``; each must be >= ``minimum``."""
    values: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdecimal() or int(part) < minimum:
            raise InputError(f"{field}: {part!r} in {text!r} is not an integer >= {minimum}")
        values.append(int(part))
    if not values:
        raise InputError(f"{field}: empty list")
    return values


def require_multiple(value: int, multiple: int, *, field: str) -> int:
    """Return ``value`` if it is a positive multiple of ``multiple``, else raise."""
    if value <= 0 or value % multiple:
        raise InputError(f"{field}: {value} is not a positive multiple of {multiple}")
    return value


def format_size(value: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
