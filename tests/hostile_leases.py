"""Entries at a tree's lease name that pykv did not write, one planter each (``test_lease``,
``test_evictor`` and ``test_fsck`` check each is found, moved to quarantine and taken over)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from pykv.tree import LEASE_NAME, MARKER_NAME, KVTree

YEAR_2100 = 4102444800.0


def lease_json(expires_at: object) -> bytes:
    """A lease's fields around ``expires_at``, written as JSON text (``Infinity``/``NaN`` as Python writes them)."""
    return json.dumps({"holder": "planted", "token": "00", "expires_at": expires_at, "host": "h", "pid": 1}).encode()


def _write(content: bytes) -> Callable[[Path, Path], None]:
    return lambda path, outside: path.write_bytes(content)


def _hard_link(path: Path, outside: Path) -> None:
    (outside / "linked").write_bytes(lease_json(time.time() + 30))  # a lease otherwise: only its links are wrong
    os.link(outside / "linked", path)


def _sparse(path: Path, outside: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(1 << 30)


def _future_mtime(path: Path, outside: Path) -> None:
    path.write_bytes(lease_json(time.time() + 30))  # unexpired, within a term: only its mtime is wrong
    later = time.time() + 86400
    os.utime(path, (later, later))


def _outside_link(path: Path, outside: Path) -> None:
    (outside / "victim").write_bytes(b"keep")
    path.symlink_to(outside / "victim")


#: case -> (planter of ``<state dir>/evict.lease``, given a directory outside the tree; its ``LeaseFault`` value)
HOSTILE: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "hard-link": (_hard_link, "linked"),
    "directory": (lambda path, outside: path.mkdir(), "not-a-file"),
    "symlink-inside": (lambda path, outside: path.symlink_to(Path("..") / MARKER_NAME), "not-a-file"),
    "symlink-outside": (_outside_link, "not-a-file"),
    "fifo": (lambda path, outside: os.mkfifo(path), "not-a-file"),
    "sparse-1g": (_sparse, "oversized"),
    "garbage": (_write(b"\x00garbage\xff{"), "unparsable"),
    "expiry-2100": (_write(lease_json(YEAR_2100)), "far-expiry"),
    "expiry-infinity": (_write(lease_json(float("inf"))), "non-finite"),
    "expiry-nan": (_write(lease_json(float("nan"))), "non-finite"),
    "expiry-1e308": (_write(lease_json(1e308)), "far-expiry"),
    "expiry-negative": (_write(lease_json(-1.0)), "far-expiry"),
    "expiry-string": (_write(lease_json(str(YEAR_2100))), "unparsable"),
    "future-mtime": (_future_mtime, "future-mtime"),
}


def plant(tree: KVTree, case: str, outside: Path) -> Path:
    """Plant ``case`` at the tree's lease name; returns that path."""
    outside.mkdir(exist_ok=True)
    tree.ensure_state_dir()
    path = tree.state_dir / LEASE_NAME
    HOSTILE[case][0](path, outside)
    return path


def quarantined(tree: KVTree) -> list[Path]:
    """Every entry moved to quarantine from the lease's name (``<run>/.pykv/evict.lease``)."""
    top = tree.state_dir / "quarantine"
    runs = sorted(os.listdir(top)) if top.is_dir() else []
    return [top / run / ".pykv" / LEASE_NAME for run in runs if os.path.lexists(top / run / ".pykv" / LEASE_NAME)]


def check_outside_intact(tree: KVTree, outside: Path) -> None:
    """What the planted links point at is as it was."""
    if (outside / "victim").exists():
        assert (outside / "victim").read_bytes() == b"keep"
    if (outside / "linked").exists():
        assert json.loads((outside / "linked").read_bytes())["holder"] == "planted"
    assert json.loads((tree.root / MARKER_NAME).read_bytes())
