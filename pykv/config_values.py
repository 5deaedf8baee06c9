"""Parsers of one ``kv_connector_extra_config`` value each (``PykvConfig``'s fields name them):
``parse(value, key)`` returns the typed value or raises ``InputError`` naming the key."""

from __future__ import annotations

import math
import os
from typing import Any, Callable

from pykv.codec import CHUNK_BOUNDS, CODEC_NAMES, UnknownCodecError, chunk_allowed
from pykv.deviceset import MAX_DEVICES
from pykv.errors import InputError
from pykv.units import parse_duration, parse_size

PREFIX = "kv_connector_extra_config"
SWITCH_MS = (0.05, 100.0)
"""The bounds of ``gil_switch_ms`` (the interpreter's own default is 5 ms)."""
IDLE_WAIT_MS = (0.0, 50.0)
"""The bounds of ``idle_wait_ms`` (0: never wait)."""
MAX_STEP_BLOCKS = 16
"""Loads one device-codec step takes at most (``codec_step_blocks``; its scratch grows with it)."""


def _size(value: Any, key: str) -> int:
    return parse_size(value if isinstance(value, (int, str)) else str(value), field=f"{PREFIX}.{key}")


def _is_auto(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() == "auto")


def _staging(value: Any, key: str) -> int | None:
    return None if _is_auto(value) else _size(value, key)


def _codec_chunk(value: Any, key: str) -> int | None:
    if _is_auto(value):
        return None
    chunk, (least, most, multiple) = _size(value, key), CHUNK_BOUNDS
    if not chunk_allowed(chunk):
        raise InputError(f"{PREFIX}.{key}: {chunk} bytes; a multiple of {multiple >> 10} KiB from {least >> 10} KiB "
                         f"to {most >> 20} MiB, or auto")
    return chunk


def _auto_or_int(maximum: int) -> Callable[[Any, str], int | None]:
    """A parser of ``auto`` (None) or an integer in 1..``maximum``."""
    def parse(value: Any, key: str) -> int | None:
        if _is_auto(value):
            return None
        try:
            return _positive_int(maximum)(value, key)
        except InputError:
            raise InputError(f"{PREFIX}.{key}: expected auto or an integer from 1 to {maximum}, "
                             f"got {str(value)[:40]!r}") from None
    return parse


_step_blocks = _auto_or_int(MAX_STEP_BLOCKS)
_threads_or_auto = _auto_or_int(64)


def _roots(value: Any, key: str) -> tuple[str, ...]:
    items = tuple(value) if isinstance(value, (list, tuple)) else None
    if items is None or (isinstance(value, list) and not items) or not all(isinstance(item, str) and item.strip() for item in items):
        raise InputError(f"{PREFIX}.{key}: expected a list of directory paths, one per device, got {str(value)[:80]!r}")
    if len(items) > MAX_DEVICES:
        raise InputError(f"{PREFIX}.{key}: {len(items)} directories; at most {MAX_DEVICES} devices")
    for index, item in enumerate(items):
        _require_absolute(item, f"{key}[{index}]")
    return items


def _require_absolute(path: str, key: str) -> None:
    """Roots are absolute: an engine's current directory is no one's choice (``pykv`` commands resolve
    a relative --root against theirs)."""
    if not os.path.isabs(path):
        raise InputError(f"{PREFIX}.{key}: expected an absolute path, got {path[:80]!r}")


def _segment(value: Any, key: str) -> int:
    size = _size(value, key)
    if size % 4096:
        raise InputError(f"{PREFIX}.{key}: expected a multiple of 4 KiB (O_DIRECT alignment) or 0, got {value!r}")
    return size


def _duration(value: Any, key: str) -> float:
    return parse_duration(value if isinstance(value, (int, float, str)) else str(value), field=f"{PREFIX}.{key}")


def _interval(value: Any, key: str) -> float:
    seconds = _duration(value, key)
    if seconds < 0.1:
        raise InputError(f"{PREFIX}.{key}: expected a duration of at least 0.1s, got {value!r}")
    return seconds


def _deadline(value: Any, key: str) -> float:
    seconds = _duration(value, key)
    if seconds < 0.01:
        raise InputError(f"{PREFIX}.{key}: expected a duration of at least 0.01s, got {value!r}")
    return seconds


def _positive_int(maximum: int) -> Callable[[Any, str], int]:
    """A parser of integers in 1..``maximum``."""
    return _int_range(1, maximum)


def _int_range(minimum: int, maximum: int) -> Callable[[Any, str], int]:
    """A parser of integers in ``minimum``..``maximum`` (a bound so no key can ask for unbounded resources)."""
    def parse(value: Any, key: str) -> int:
        text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
        digits = text.isascii() and text.isdecimal()
        if not digits or len(text) > len(str(maximum)) or not minimum <= int(text) <= maximum:
            raise InputError(f"{PREFIX}.{key}: expected an integer from {minimum} to {maximum}, got {str(value)[:40]!r}")
        return int(text)
    return parse


def _margin(value: Any, key: str) -> float:
    try:
        margin = float(value)
    except (TypeError, ValueError):
        margin = math.nan
    if not 0 <= margin <= 10 or isinstance(value, bool):
        raise InputError(f"{PREFIX}.{key}: expected a fraction between 0 and 10 (0.05 = 5 %), got {value!r}")
    return margin


def _bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InputError(f"{PREFIX}.{key}: expected true or false, got {value!r}")


def _mode(value: Any, key: str) -> int:
    text = str(value).strip()
    try:
        mode = int(text, 8) if isinstance(value, str) else int(value)
    except ValueError:
        raise InputError(f"{PREFIX}.{key}: expected an octal mode like \"0600\", got {value!r}") from None
    if not 0 <= mode <= 0o777:
        raise InputError(f"{PREFIX}.{key}: mode {value!r} is outside 0000..0777")
    return mode


def _choice(*choices: str) -> Callable[[Any, str], str]:
    def parse(value: Any, key: str) -> str:
        if value not in choices:
            raise InputError(f"{PREFIX}.{key}: expected one of {', '.join(choices)}, got {value!r}")
        return value
    return parse


def _milliseconds(value: Any, key: str, bounds: tuple[float, float], also: str = "") -> float:
    """Milliseconds within ``bounds``; ``also``: the other words the key takes (for the message)."""
    low, high = bounds
    try:
        ms = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        ms = None
    if ms is None or not low <= ms <= high:  # NaN fails too
        raise InputError(f"{PREFIX}.{key}: expected {also}milliseconds from {low:g} to {high:g}, "
                         f"got {str(value)[:40]!r}")
    return ms


def _switch_ms(value: Any, key: str) -> float | None:
    """``keep`` (None) or milliseconds in ``SWITCH_MS``."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "keep"):
        return None
    return _milliseconds(value, key, SWITCH_MS, "keep or ")


def _idle_wait_ms(value: Any, key: str) -> float:
    """Milliseconds in ``IDLE_WAIT_MS``."""
    return _milliseconds(value, key, IDLE_WAIT_MS)


def _codec(value: Any, key: str) -> str:
    if not isinstance(value, str) or value not in CODEC_NAMES:
        raise UnknownCodecError(f"{PREFIX}.{key}: unknown codec {str(value)[:40]!r} (known: {', '.join(CODEC_NAMES)})")
    return value


def _root(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{PREFIX}.{key}: expected a directory path, got {value!r}")
    _require_absolute(value, key)
    return value


def _optional_path(value: Any, key: str) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise InputError(f"{PREFIX}.{key}: expected a file path, got {value!r}")
    return value

