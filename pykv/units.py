"""Parsing of human-written sizes, durations and integer lists (``28M``, ``10m``, ``1,4,16``)."""

from __future__ import annotations

import re

from pykv.errors import InputError

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_UNIT = r"(?:([KMGTP])(?:I?B)?|B)"  # K, KB, KiB (all binary) ... P, PiB; B: bytes; any case
_SIZE_RE = re.compile(rf"^\s*(\d+(?:\.\d+)?)\s*{_UNIT}?\s*$", re.IGNORECASE | re.ASCII)  # ASCII digits only
_UNIT_RE = re.compile(rf"^{_UNIT}$", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.ASCII)
MAX_SIZE = (1 << 63) - 1  # what a file offset (off_t) can express
MAX_DURATION_S = 100 * 365 * 86400.0  # a century: longer than any tree lives
_MAX_DIGITS = 40  # longer numbers are refused before any arithmetic on them


def parse_size(text: str | int, *, field: str = "size") -> int:
    """Bytes from ``"500G"``, ``"28M"``, ``"1.5GiB"`` (binary units, any case: K, KB and KiB are
    1024) or ``"4096"`` (a bare number is bytes): the one parser of every size flag and key."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InputError(f"{field}: must not be negative, got {_short(text)}")
        if text > MAX_SIZE:
            raise InputError(f"{field}: must be at most {MAX_SIZE}, got {_short(text)}")
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise InputError(f"{field}: cannot parse size {_short(text)!r} (a number of bytes, or with a binary unit: "
                         f"4096, 28M, 500G, 1.5GiB)")
    number, unit = match.groups()
    value = _bounded(number, _SIZE_UNITS[(unit or "").upper()], MAX_SIZE, field, "size")
    return int(value)


def is_unit_word(text: str) -> bool:
    """True for a size unit alone (``G``, ``GB``, ``gib``, ``B``): the second half of ``16 GB``
    split into two arguments."""
    return bool(_UNIT_RE.match(text))


def parse_duration(text: str | float, *, field: str = "duration") -> float:
    """Seconds from ``"10m"``, ``"30s"``, ``"2h"``, ``"1d"`` or a plain number of seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise InputError(f"{field}: must not be negative, got {_short(text)}")
        if not text <= MAX_DURATION_S:  # NaN fails too
            raise InputError(f"{field}: must be at most {MAX_DURATION_S:.0f} seconds, got {_short(text)}")
        return float(text)
    match = _DURATION_RE.match(str(text))
    if not match:
        raise InputError(f"{field}: cannot parse duration {_short(text)!r} (examples: 30s, 10m, 2h, 1d)")
    number, unit = match.groups()
    return _bounded(number, _DURATION_UNITS[unit], MAX_DURATION_S, field, "duration")


def _bounded(number: str, unit: float, maximum: float, field: str, what: str) -> float:
    """``number`` x ``unit`` if it is at most ``maximum``; one ``InputError`` line otherwise
    (hundreds of digits included: no float overflow, no traceback)."""
    whole = number.split(".")[0].lstrip("0")
    value = float(number) * unit if len(whole) <= _MAX_DIGITS else float("inf")
    if not value <= maximum:
        raise InputError(f"{field}: {what} {_short(number)} is too large (at most {int(maximum)}"
                         f"{' bytes' if what == 'size' else ' seconds'})")
    return value


def _short(value: object) -> str:
    """``value`` as text, cut to 40 characters (a number of 400 digits fits in one line)."""
    text = str(value) if not isinstance(value, int) or value.bit_length() < 4000 else "a huge number"
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def parse_int_list(text: str, *, field: str = "list", minimum: int = 1) -> list[int]:
    """Integers from ``"1,4,16,64"``; each must be >= ``minimum``."""
    values: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not (part.isascii() and part.isdecimal()) or len(part) > _MAX_DIGITS or int(part) < minimum:
            raise InputError(f"{field}: {_short(part)!r} in {_short(text)!r} is not an integer >= {minimum} "
                             f"of at most {_MAX_DIGITS} digits")
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
