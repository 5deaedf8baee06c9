"""Counting what a tree's quarantine holds: ``<root>/.pykv/quarantine``, where ``fsck --repair`` and
the engines move damaged blocks and foreign entries (``KVTree.quarantine``).

What lies there is hostile by definition (it was moved there for not being pykv's), so the
count opens each directory below the root's fd without following a symlink (a link, FIFO or
device anywhere below is neither followed, opened nor counted), stops after ``limit`` entries
and ``MAX_DEPTH`` levels, and counts what it cannot read (``unreadable``) instead of failing;
``complete`` is False whenever the counts are lower bounds. One count for every reader: the
engine's gauges (``pykv.maintenance.gauges``), ``pykv inspect`` and ``pykv fsck``.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from pykv.io.safe_paths import directory_fd
from pykv.maintenance.scan import allocated_size
from pykv.tree import QUARANTINE_DIR, STATE_DIR, KVTree

QUARANTINE_WALK_LIMIT = 100_000
"""Entries a count looks at before it stops (its counts are then lower bounds)."""
MAX_DEPTH = 32  # <run>/<namespace>/<aa>/<bb>/<block> is 5; a moved foreign directory adds its own
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class QuarantineUsage:
    """Regular files in a quarantine and the bytes they occupy (a sparse file: what it holds);
    ``unreadable``: directories or entries in it that could not be read; ``complete`` is False when
    the counts are lower bounds (a limit reached, something unreadable)."""

    files: int
    bytes: int
    complete: bool = True
    unreadable: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


UNREADABLE = QuarantineUsage(0, 0, complete=False, unreadable=1)
"""The count of a quarantine that cannot be opened at all (``counted``)."""


def quarantine_usage(tree: KVTree, *, limit: int = QUARANTINE_WALK_LIMIT) -> QuarantineUsage:
    """Count ``tree``'s quarantine (a missing one is empty). ``OSError`` when the quarantine itself
    cannot be opened (a link planted at ``.pykv`` or ``quarantine``: ``ELOOP``); what cannot be read
    inside it is counted in ``unreadable``."""
    try:
        with directory_fd(tree.root, f"{STATE_DIR}/{QUARANTINE_DIR}") as path_fd:  # no link followed: ELOOP
            top = os.open(".", _DIRECTORY, dir_fd=path_fd)
    except FileNotFoundError:
        return QuarantineUsage(0, 0)
    walk = _Walk(limit)
    try:
        walk.directory(top, 1)
    finally:
        os.close(top)
    return QuarantineUsage(walk.files, walk.bytes, walk.complete, walk.unreadable)


def counted(tree: KVTree) -> QuarantineUsage:
    """``quarantine_usage`` for a report: a quarantine that cannot be opened is ``UNREADABLE``, not an error."""
    try:
        return quarantine_usage(tree)
    except OSError:
        return UNREADABLE


def combined(usages: Iterable[QuarantineUsage]) -> QuarantineUsage:
    """The quarantines of several devices as one count."""
    usages = list(usages)
    return QuarantineUsage(sum(u.files for u in usages), sum(u.bytes for u in usages),
                           all(u.complete for u in usages), sum(u.unreadable for u in usages))


class _Walk:
    """One bounded count: open directories are its depth at most (each entered by name below its parent's fd)."""

    def __init__(self, limit: int) -> None:
        self.left, self.files, self.bytes, self.unreadable, self.complete = limit, 0, 0, 0, True

    def directory(self, fd: int, depth: int) -> None:
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if self.left <= 0:
                        self.complete = False
                        return
                    self.left -= 1
                    self.entry(fd, entry, depth)
        except OSError:  # the listing itself failed (EIO)
            self._unreadable()

    def entry(self, parent: int, entry: os.DirEntry, depth: int) -> None:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return  # removed while counted (an operator, fsck)
        except OSError:
            self._unreadable()
            return
        if stat.S_ISREG(st.st_mode):
            self.files += 1
            self.bytes += allocated_size(st)
        if not stat.S_ISDIR(st.st_mode):
            return  # a link, FIFO, socket or device: never followed or opened
        if depth >= MAX_DEPTH:
            self.complete = False
            return
        try:
            below = os.open(entry.name, _DIRECTORY, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):  # not gone or swapped meanwhile
                self._unreadable()
            return
        try:
            self.directory(below, depth + 1)
        finally:
            os.close(below)

    def _unreadable(self) -> None:
        self.unreadable += 1
        self.complete = False
