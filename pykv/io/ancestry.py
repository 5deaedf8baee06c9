"""Directories as the file system knows them: ``(st_dev, st_ino)`` and the chain of parents.

A path string can hide that two roots are one directory (a bind mount, a symbolic link) or
that one lies inside another (``M/sub`` with ``M`` a bind mount of ``A``). The kernel's ``..``
of an open directory is its real parent (a mount's ``..`` is its mount point's parent), so
following ``..`` by fd until it stops changing visits every directory a path really lies in,
whatever spelling named it. One thing ``..`` hides: a bind mount of a subdirectory (``M`` a bind
mount of ``A/x``) has its mount point's parent as ``..``, not ``A``. Past such a mount's root the
walk visits both: the ``..`` chain, then ``A``'s where another mount of the same file system
shows it (``/proc/self/mountinfo``: the mount's ``root`` field); where none does (a container
given only that subdirectory), the parents it cannot see are not visited. The walk is bounded
(``MAX_DEPTH``) and opens with ``O_PATH``: it reads nothing and needs no read permission.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterator

from pykv.io.mounts import Mount, read_mounts

DirId = tuple[int, int]
"""A directory's ``(st_dev, st_ino)``: the same for every path that reaches it."""

MAX_DEPTH = 2048  # PATH_MAX (4096) allows at most this many components
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def walk_up(directory: Path | str) -> Iterator[tuple[int, DirId]]:
    """``(fd, id)`` of ``directory`` (a link to one is followed) and of each directory above it up to
    ``/``, nearest first; then, for each bind-mounted subdirectory met on the way whose real parent
    a mount shows, that parent and the directories above it. No directory comes twice; each fd is
    open until the next step. ``OSError`` if one cannot be opened."""
    mounts: list[Mount] | None = None
    seen: set[DirId] = set()
    starts = [os.open(directory, _DIR_FLAGS)]  # the chains still to walk
    steps = 0
    try:
        while starts:
            fd = starts.pop(0)
            try:
                here = _mount_id(fd)
                while True:
                    st = os.fstat(fd)
                    current = (st.st_dev, st.st_ino)
                    if current in seen:  # ``/..`` is ``/``; or this chain joined one already walked
                        break
                    steps += 1
                    if steps > MAX_DEPTH:
                        raise OSError(errno.ELOOP, f"more than {MAX_DEPTH} directories above it", os.fspath(directory))
                    seen.add(current)
                    yield fd, current
                    parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = parent  # closed by ``finally`` from here on
                    crossed, here = here, _mount_id(fd)
                    if crossed is not None and crossed != here:  # the one left was a mount's root
                        mounts = mounts if mounts is not None else (read_mounts() or [])
                        hidden = _hidden_parent(mounts, crossed, st.st_dev)
                        if hidden is not None:
                            starts.append(hidden)
            finally:
                os.close(fd)
    finally:
        for fd in starts:
            os.close(fd)


def _mount_id(fd: int) -> int | None:
    """The id of the mount ``fd`` lies on (``/proc/self/fdinfo``); None where that cannot be read."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as info:
            for line in info.read(4096).splitlines():
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _hidden_parent(mounts: list[Mount], mount_id: int, device: int) -> int | None:
    """An ``O_PATH`` fd of the parent, in its own file system (``device``: its ``st_dev``), of
    mount ``mount_id``'s root where that root is a subdirectory (a bind mount) and another mount
    of the file system shows the parent; None otherwise (the root of its file system, or a parent
    no mount shows)."""
    mount = next((m for m in mounts if m.mount_id == mount_id), None)
    if mount is None or mount.root in ("/", "") or not mount.root.startswith("/") or mount.root.endswith("//deleted"):
        return None  # a file system's root; or a directory removed since it was mounted (no parent to show)
    parent = os.path.dirname(mount.root.rstrip("/"))
    for other in mounts:
        if other.device != mount.device or other.mount_id == mount_id:
            continue
        base = other.root.rstrip("/")
        if parent != (base or "/") and not parent.startswith(base + "/"):
            continue
        try:
            fd = os.open(other.mount_point.rstrip("/") + parent[len(base):] or "/", _DIR_FLAGS)
        except OSError:
            continue  # removed, not a directory: another mount may still show it
        if os.fstat(fd).st_dev == device:
            return fd
        os.close(fd)  # another file system mounted over that path
    return None


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
