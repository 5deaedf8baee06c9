"""The eviction record (``.pykv/evict.json``): written and read back, judged as hostile input, the status."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from treefactory import make_tree

from pykv.maintenance.evict_record import (RECORD_LIMIT, EvictionState, EvictRecord, RecordDefect, check_record,
                                           eviction_status, one_line, quarantine_record, read_record, record_round)
from pykv.maintenance.lease import StateFault
from pykv.tree import EVICT_RECORD_NAME, KVTree

MIB = 1 << 20


def sound(now: float, **changes) -> EvictRecord:
    fields = dict(at=now - 5, ok_at=now - 5, behind=False, tree_bytes=3 * MIB, limit=4 * MIB, interval_s=10.0,
                  error=None, holder="vm.1.ab", host="vm")
    return EvictRecord(**{**fields, **changes})


def fields(now: float, **changes) -> bytes:
    return json.dumps({**sound(now).as_dict(), **changes}).encode()


def record_path(tree: KVTree) -> Path:
    return tree.state_dir / EVICT_RECORD_NAME


def test_a_record_reads_back_as_written_and_leaves_no_temp(tmp_path):
    tree, now = make_tree(tmp_path), time.time()
    assert read_record(tree) is None and eviction_status(tree).state is EvictionState.NEVER
    record_round(tree, sound(now))
    record_round(tree, sound(now, error="disk on fire"))  # replaced, not appended
    assert read_record(tree, now) == sound(now, error="disk on fire")
    assert sorted(os.listdir(tree.state_dir)) == [EVICT_RECORD_NAME]


def test_an_error_is_kept_to_one_short_line():
    assert one_line(OSError(5, "I/O error\nat line two")) == "[Errno 5] I/O error at line two"
    assert len(one_line("x" * 10_000)) == 300


def _fifo(path: Path, outside: Path) -> None:
    os.mkfifo(path)


def _symlink(path: Path, outside: Path) -> None:
    (outside / "target.json").write_bytes(b"{}")
    path.symlink_to(outside / "target.json")


def _directory(path: Path, outside: Path) -> None:
    path.mkdir()


def _hard_link(path: Path, outside: Path) -> None:
    (outside / "linked.json").write_bytes(fields(time.time()))
    os.link(outside / "linked.json", path)


def _huge(path: Path, outside: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(1 << 40)  # sparse: a reader that allocates from the size would need a TiB


def _write(content: bytes):
    return lambda path, outside: path.write_bytes(content)


def _future_mtime(path: Path, outside: Path) -> None:
    path.write_bytes(fields(time.time()))
    later = time.time() + 86400
    os.utime(path, (later, later))


NOW = time.time()
HOSTILE = {
    "fifo": (_fifo, StateFault.NOT_A_FILE),
    "symlink": (_symlink, StateFault.NOT_A_FILE),
    "directory": (_directory, StateFault.NOT_A_FILE),
    "hard-link": (_hard_link, StateFault.LINKED),
    "huge": (_huge, StateFault.OVERSIZED),
    "just-over": (_write(b" " * (RECORD_LIMIT + 1)), StateFault.OVERSIZED),
    "garbage": (_write(b"\x00\xff garbage {"), StateFault.UNPARSABLE),
    "deep": (_write(b"[" * 4000), StateFault.UNPARSABLE),
    "a-list": (_write(b"[1, 2]"), StateFault.UNPARSABLE),
    "bool-bytes": (_write(fields(NOW, tree_bytes=True)), StateFault.UNPARSABLE),
    "string-time": (_write(fields(NOW, at="yesterday")), StateFault.UNPARSABLE),
    "negative-bytes": (_write(fields(NOW, limit=-1)), StateFault.UNPARSABLE),
    "success-after-round": (_write(fields(NOW, ok_at=NOW)), StateFault.UNPARSABLE),
    "nan": (_write(fields(NOW, at=float("nan"))), StateFault.NON_FINITE),
    "infinite-interval": (_write(fields(NOW, interval_s=float("inf"))), StateFault.NON_FINITE),
    "huge-number": (_write(fields(NOW).replace(b'"at": ', b'"at": 1e999999, "x": ')), StateFault.NON_FINITE),
    "future-round": (_write(fields(NOW, at=NOW + 86400, ok_at=NOW)), StateFault.FUTURE_TIME),
    "future-mtime": (_future_mtime, StateFault.FUTURE_MTIME),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_what_pykv_did_not_write_is_one_line_never_a_crash_and_is_moved_by_repair(tmp_path, case):
    tree = make_tree(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    plant, fault = HOSTILE[case]
    tree.ensure_state_dir()
    plant(record_path(tree), outside)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    found = read_record(tree)
    assert isinstance(found, RecordDefect) and found.fault is fault, found
    status = eviction_status(tree)
    assert status.state is EvictionState.UNREADABLE and status.flagged
    assert status.line().startswith("unreadable eviction record (") and "\n" not in status.line()
    assert check_record(tree) == found
    moved = quarantine_record(tree, "run1")
    assert moved is not None and not os.path.lexists(record_path(tree)) and os.path.lexists(moved)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before  # never followed, never written
    if case == "symlink":
        assert (outside / "target.json").read_bytes() == b"{}" and moved.is_symlink()


def test_a_sound_record_is_not_moved(tmp_path):
    tree = make_tree(tmp_path)
    with pytest.raises(FileNotFoundError):
        quarantine_record(tree, "run1")
    record_round(tree, sound(time.time()))
    assert check_record(tree) is None and quarantine_record(tree, "run1") is None and record_path(tree).exists()


def test_status_healthy_behind_failing_and_stale(tmp_path):
    tree, now = make_tree(tmp_path), time.time()
    record_round(tree, sound(now))
    healthy = eviction_status(tree, now)
    assert healthy.state is EvictionState.OK and not healthy.flagged and healthy.threshold_s == 600.0
    assert healthy.line() == "last round 5s ago by vm, last success 5s ago, 3.0 MiB of 4.0 MiB"
    record_round(tree, sound(now, behind=True, tree_bytes=5 * MIB))
    behind = eviction_status(tree, now)
    assert behind.state is EvictionState.STUCK and behind.as_dict()["behind"] is True
    assert behind.line().startswith("STUCK (behind: ") and "5.0 MiB of 4.0 MiB (behind)" in behind.line()
    record_round(tree, sound(now, at=now - 1, ok_at=now - 3600, error="[Errno 5] I/O error", interval_s=100.0))
    failing = eviction_status(tree, now)
    assert failing.state is EvictionState.STUCK and failing.threshold_s == 1000.0
    assert failing.line() == ("STUCK (no successful round for over 1000 s): last round 1s ago by vm, last success "
                              "1h ago, 3.0 MiB of 4.0 MiB, last error: [Errno 5] I/O error")
    record_round(tree, sound(now, ok_at=None, error="boom"))
    assert eviction_status(tree, now).state is EvictionState.STUCK  # never succeeded
    record_round(tree, sound(now, at=now - 30, ok_at=now - 300, error="boom"))
    assert eviction_status(tree, now).state is EvictionState.OK  # one failure within the threshold: not stuck
