"""The last eviction round on a device, for operators: ``<root>/.pykv/evict.json``.

Every round an engine's evictor runs on a device (``pykv.maintenance.evictor``), successful
or failed, replaces this small file (``record_round``: a synced temp renamed over it, as
``gc.json`` is published): when the round ran, when a round last succeeded, whether it left
the device over ``max_tree_bytes`` (behind), the bytes it left, the limit and interval, the
error of a failed round in one line, and who ran it. It costs one write per round and no walk.

``pykv inspect`` and ``pykv doctor`` read it (``eviction_status``) and flag eviction as
STUCK when the device is behind or no round succeeded for ``STUCK_ROUNDS`` intervals (at
least ``MAX_TERM_S``, the lease's longest term). The file is hostile input: judged from its
``lstat`` (no FIFO opened, no link followed), read no further than ``RECORD_LIMIT + 1``
bytes, strict field types, finite times not in the future; anything else is a
``RecordDefect`` shown in one line, reported by ``pykv fsck`` and moved to quarantine by
``fsck --repair`` (``quarantine_record``, the lease's mover).
"""

from __future__ import annotations

import enum
import errno
import json
import math
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pykv.io.safe_paths import directory_fd
from pykv.io.small_files import replace_small
from pykv.maintenance.lease import (CLOCK_SKEW_S, MAX_TERM_S, StateDefect, StateFault, quarantine_state_file,
                                    read_state_file)
from pykv.tree import EVICT_RECORD_NAME, HOST, STATE_DIR, KVTree
from pykv.units import format_size

RECORD_LIMIT = 4096  # a record is ~300 bytes; anything larger is not one
RECORD_PATH = f"{STATE_DIR}/{EVICT_RECORD_NAME}"  # relative to the root
STUCK_ROUNDS = 10  # no successful round for this many intervals (at least MAX_TERM_S): stuck
ERROR_CHARS = 300  # a failed round's error is kept to one line of at most this many characters
_TEXT_CHARS = 1000  # holder, host and error as read: longer is not a record pykv wrote
_MAX_INTERVAL_S = 7 * 86400.0


@dataclass(frozen=True)
class EvictRecord:
    """One round's outcome on one device (times in wall-clock seconds)."""

    at: float  # when the round ended
    ok_at: float | None  # when a round last succeeded (None: never, as far as this file knows)
    behind: bool  # the last successful round left the device over ``limit``
    tree_bytes: int  # the device's blocks after the last successful round
    limit: int
    interval_s: float
    error: str | None = None  # this round failed: why, in one line
    holder: str = ""
    host: str = HOST

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


RecordDefect = StateDefect  # at the record's name (``path``: ``RECORD_PATH``)


def one_line(error: BaseException | str) -> str:
    """An error as one short line (``ERROR_CHARS`` at most)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 3] + "..."


def record_round(tree: KVTree, record: EvictRecord) -> None:
    """Publish ``record`` as the device's ``evict.json`` (temp, then rename over; ``OSError`` on failure)."""
    content = json.dumps(record.as_dict(), allow_nan=False).encode()
    with directory_fd(tree.root, STATE_DIR, create_mode=tree.options.dir_mode) as fd:
        replace_small(EVICT_RECORD_NAME, content, tree.options.file_mode, dir_fd=fd)


def read_record(tree: KVTree, now: float | None = None) -> EvictRecord | RecordDefect | None:
    """The device's record (None: there is none, or no ``.pykv``), or the defect of what stands there;
    ``OSError`` when ``.pykv`` cannot be entered."""
    now = time.time() if now is None else now
    try:
        with directory_fd(tree.root, STATE_DIR) as fd:
            return _judge(fd, now)
    except (FileNotFoundError, NotADirectoryError):
        return None


def check_record(tree: KVTree, now: float | None = None) -> RecordDefect | None:
    """What is wrong with what stands at the record's name (None: nothing, or a sound record)."""
    try:
        found = read_record(tree, now)
    except OSError:  # .pykv cannot be entered: the walk reports that
        return None
    return found if isinstance(found, RecordDefect) else None


def quarantine_record(tree: KVTree, run: str) -> Path | None:
    """Move a ``RecordDefect`` at the record's name into ``.pykv/quarantine/<run>``; returns where, or
    None when a sound record stands there (left). ``FileNotFoundError`` if nothing is there."""
    found = check_record(tree)
    if found is None:
        if read_record(tree) is None:
            raise FileNotFoundError(errno.ENOENT, "no eviction record", RECORD_PATH)
        return None
    return quarantine_state_file(tree, EVICT_RECORD_NAME, run, found.identity)


def _judge(fd: int, now: float) -> EvictRecord | RecordDefect | None:
    found = read_state_file(fd, EVICT_RECORD_NAME, limit=RECORD_LIMIT, noun="record", path=RECORD_PATH,
                            settle=False, now=now)
    return _parse(found[1], found[0], now) if isinstance(found, tuple) else found


def _parse(raw: bytes, st: os.stat_result, now: float) -> EvictRecord | RecordDefect:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return _defect(st, StateFault.UNPARSABLE, "not JSON")
    if not (isinstance(data, dict) and _is_number(data.get("at")) and _is_number(data.get("interval_s"))
            and (data.get("ok_at") is None or _is_number(data["ok_at"])) and type(data.get("behind")) is bool
            and _is_count(data.get("tree_bytes")) and _is_count(data.get("limit"))
            and (data.get("error") is None or _is_text(data["error"]))
            and _is_text(data.get("holder")) and _is_text(data.get("host"))):
        return _defect(st, StateFault.UNPARSABLE, "not a record's fields and types")
    times = [float(data["at"]), float(data["interval_s"])] + ([] if data["ok_at"] is None else [float(data["ok_at"])])
    if not all(math.isfinite(t) for t in times):
        return _defect(st, StateFault.NON_FINITE, "a time that is not finite")
    at, interval_s, ok_at = times[0], times[1], None if data["ok_at"] is None else times[2]
    if not (at > 0 and 0 < interval_s <= _MAX_INTERVAL_S and (ok_at is None or 0 < ok_at <= at)):
        return _defect(st, StateFault.UNPARSABLE, "times out of order or out of range")
    if at > now + CLOCK_SKEW_S:
        return _defect(st, StateFault.FUTURE_TIME, f"a round {at - now:.0f} s in the future")
    return EvictRecord(at, ok_at, data["behind"], data["tree_bytes"], data["limit"], interval_s,
                       None if data["error"] is None else one_line(data["error"]), data["holder"][:200],
                       data["host"][:64])


def _is_number(value: object) -> bool:
    return type(value) in (int, float)


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def _is_text(value: object) -> bool:
    return isinstance(value, str) and len(value) <= _TEXT_CHARS


def _defect(st: os.stat_result, fault: StateFault, detail: str) -> RecordDefect:
    return StateDefect(fault, detail, (st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode), stat.S_ISLNK(st.st_mode),
                       RECORD_PATH)


# -- what operators see ------------------------------------------------------------------------
class EvictionState(str, enum.Enum):
    NEVER = "never"  # no record: no engine with max_tree_bytes has run a round here
    OK = "ok"
    STUCK = "stuck"  # behind, or no successful round for the threshold
    UNREADABLE = "unreadable"  # a RecordDefect stands at the record's name


@dataclass(frozen=True)
class EvictionStatus:
    """A device's eviction as ``inspect`` and ``doctor`` show it (ages in seconds as of reading)."""

    state: EvictionState
    record: EvictRecord | None = None
    last_round_age_s: float | None = None
    last_success_age_s: float | None = None
    threshold_s: float | None = None
    reason: str = ""  # why stuck, or why unreadable

    @property
    def flagged(self) -> bool:
        return self.state in (EvictionState.STUCK, EvictionState.UNREADABLE)

    def as_dict(self) -> dict[str, Any]:
        record = self.record
        return {"state": self.state.value, "stuck": self.state is EvictionState.STUCK, "reason": self.reason or None,
                "last_round_age_s": self.last_round_age_s, "last_success_age_s": self.last_success_age_s,
                "threshold_s": self.threshold_s, "behind": record.behind if record else None,
                "tree_bytes": record.tree_bytes if record else None, "limit": record.limit if record else None,
                "last_error": record.error if record else None, "holder": record.holder if record else None,
                "host": record.host if record else None}

    def line(self) -> str:
        """One line: ``never``, ``unreadable eviction record (...)``, or the ages, STUCK and the last error."""
        return status_line(self.as_dict())


def eviction_status(tree: KVTree, now: float | None = None) -> EvictionStatus:
    """The device's eviction as of ``now`` (never raises on what stands in the tree)."""
    now = time.time() if now is None else now
    try:
        found = read_record(tree, now)
    except OSError as exc:
        return EvictionStatus(EvictionState.UNREADABLE, reason=f"unreadable ({exc.strerror or exc})")
    if found is None:
        return EvictionStatus(EvictionState.NEVER)
    if isinstance(found, RecordDefect):
        return EvictionStatus(EvictionState.UNREADABLE, reason=found.detail)
    threshold = max(STUCK_ROUNDS * found.interval_s, MAX_TERM_S)
    success_age = None if found.ok_at is None else max(0.0, now - found.ok_at)
    if found.behind:
        reason = "behind: the last successful round left the device over its limit"
    elif success_age is None or success_age > threshold:
        reason = f"no successful round for over {threshold:.0f} s"
    else:
        reason = ""
    return EvictionStatus(EvictionState.STUCK if reason else EvictionState.OK, found, max(0.0, now - found.at),
                          success_age, threshold, reason)


def status_line(status: dict[str, Any]) -> str:
    """``EvictionStatus.as_dict`` (as in ``inspect --json``) as one line."""
    if status["state"] == EvictionState.NEVER.value:
        return "never (no engine with max_tree_bytes has run a round here)"
    if status["state"] == EvictionState.UNREADABLE.value:
        return f"unreadable eviction record ({status['reason']})"
    parts = [f"last round {_age(status['last_round_age_s'])} ago by {status['host']}",
             "last success " + ("never" if status["last_success_age_s"] is None
                                else f"{_age(status['last_success_age_s'])} ago"),
             f"{format_size(status['tree_bytes'])} of {format_size(status['limit'])}"
             + (" (behind)" if status["behind"] else "")]
    if status["last_error"]:
        parts.append(f"last error: {status['last_error']}")
    text = ", ".join(parts)
    return f"STUCK ({status['reason']}): {text}" if status["stuck"] else text


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
