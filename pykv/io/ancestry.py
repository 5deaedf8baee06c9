"""Directories as the file system knows them: ``(st_dev, st_ino)`` and the chain of parents.

A path string can hide that two roots are one directory (a bind mount, a symbolic link) or
that one lies inside another (``M/sub`` with ``M`` a bind mount of ``A``). The kernel's ``..``
of an open directory is its real parent (a mount's ``..`` is its mount point's parent), so
following ``..`` by fd until it stops changing visits every directory a path really lies in,
whatever spelling named it. The walk is bounded (``MAX_DEPTH``) and opens with ``O_PATH``:
it reads nothing and needs no read permission.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterator

DirId = tuple[int, int]
"""A directory's ``(st_dev, st_ino)``: the same for every path that reaches it."""

MAX_DEPTH = 2048  # PATH_MAX (4096) allows at most this many components
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def walk_up(directory: Path | str) -> Iterator[tuple[int, DirId]]:
    """``(fd, id)`` of ``directory`` (a link to one is followed) and of each directory above it up to
    ``/``, nearest first; each fd is open until the next step. ``OSError`` if one cannot be opened."""
    fd = os.open(directory, _DIR_FLAGS)
    try:
        previous: DirId | None = None
        for _ in range(MAX_DEPTH):
            st = os.fstat(fd)
            current = (st.st_dev, st.st_ino)
            if current == previous:  # ``/..`` is ``/``
                return
            yield fd, current
            previous = current
            fd, below = -1, fd
            try:
                fd = os.open("..", _DIR_FLAGS, dir_fd=below)
            finally:
                os.close(below)
        raise OSError(errno.ELOOP, f"more than {MAX_DEPTH} directories above it", os.fspath(directory))
    finally:
        if fd >= 0:
            os.close(fd)


def lineage(directory: Path | str) -> tuple[DirId, ...]:
    """The ids of ``directory`` and of every directory above it, nearest first (``walk_up``)."""
    return tuple(ident for _, ident in walk_up(directory))


def holder_of(directory: Path | str, name: str, *, include_self: bool) -> Path | None:
    """The nearest directory above ``directory`` (or ``directory`` itself with ``include_self``) that
    holds an entry ``name`` (a link counts, none is followed); None if none does."""
    for depth, (fd, _) in enumerate(walk_up(directory)):
        if depth == 0 and not include_self:
            continue
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        return _path_of(fd, directory, depth)
    return None


def _path_of(fd: int, start: Path | str, depth: int) -> Path:
    """A path of the directory open as ``fd``, ``depth`` levels above ``start`` (for messages)."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return Path(start, *([".."] * depth))
