"""Walking a pykv tree and classifying every entry it holds.

The walk never follows symlinks and takes its stat from ``os.scandir`` entries
(``lstat``), so a symlink anywhere is reported as foreign, never as what it points
to. Files may vanish while the walk runs (gc, another host's gc, a writer dropping
its temp): a ``FileNotFoundError`` just means the entry is no longer there.

What each place in the tree may hold (see ``pykv.tree`` for the layout):

=====================  ==============================================================
place                  allowed entries
=====================  ==============================================================
``<root>``             the marker, its temps, the O_DIRECT probe's temps, ``.pykv/``,
                       namespace dirs (hex names)
``<root>/.pykv``       ``catalog.db`` (and SQLite's journals), ``gc.json``, ``evict.lease``,
                       their temps, ``quarantine/`` (not walked: what is in it was moved there)
``<ns>``               ``namespace.json``, its temps, shard dirs (2 hex digits)
``<ns>/<aa>``          shard dirs (2 hex digits)
``<ns>/<aa>/<bb>``     blocks ``<hex>.kv`` (regular files) and their temps
=====================  ==============================================================

Anything else is ``FOREIGN``.

Sizes are what a file occupies, ``min(st_size, st_blocks * 512)``: a sparse file that
claims a terabyte counts for the few blocks it holds. Times from the future (a clock
ahead, a planted ``utime``) are replaced by the inode's change time, which only the
kernel sets, so no file is "recent" forever (``clamp_times``).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from pykv.tree import (BLOCK_SUFFIX, GC_STATE_NAME, LEASE_NAME, MARKER_NAME, NAMESPACE_FILE, PROBE_NAME, QUARANTINE_DIR,
                       ROOT_EXEMPT, SET_NAME, STATE_DIR, EVICT_RECORD_NAME, KVTree, is_hex, is_temp_name, is_temp_of)



class Kind(str, enum.Enum):
    """What an entry is, judged by its place, name and type (never by its content)."""

    BLOCK = "block"
    TEMP = "temp"
    METADATA = "metadata"  # the tree marker and namespace.json files
    FOREIGN = "foreign"


class Entry(NamedTuple):
    """One classified entry. ``path`` is absolute; times are nanoseconds since the epoch."""

    path: str
    kind: Kind
    namespace: str | None
    size: int
    atime_ns: int
    mtime_ns: int
    is_dir: bool = False
    is_symlink: bool = False


class LeafDir(NamedTuple):
    """A shard directory that holds blocks: ``<root>/<ns>/<aa>/<bb>``."""

    path: str
    namespace: str
    mtime_ns: int


#: Names in ``.pykv`` that pykv (or SQLite, for the catalog) writes.
STATE_FILES = frozenset({"catalog.db", "catalog.db-journal", "catalog.db-wal", "catalog.db-shm", GC_STATE_NAME,
                         LEASE_NAME, SET_NAME, EVICT_RECORD_NAME})


def is_metadata_temp(name: str) -> bool:
    """True for a temp left while publishing the marker, a ``namespace.json``, ``gc.json``, the
    eviction lease or the set record, or by the O_DIRECT probe."""
    return is_temp_of(name, (MARKER_NAME, NAMESPACE_FILE, GC_STATE_NAME, LEASE_NAME, SET_NAME, EVICT_RECORD_NAME,
                               PROBE_NAME))


def allocated_size(st: os.stat_result) -> int:
    """Bytes a file occupies: its size, but no more than its allocated blocks (sparse files)."""
    return min(st.st_size, st.st_blocks * 512)


def clamp_times(st: os.stat_result, now_ns: int) -> tuple[int, int]:
    """(atime, mtime) with any time after ``now_ns`` replaced by the change time (at most now)."""
    ctime = min(st.st_ctime_ns, now_ns)
    atime, mtime = st.st_atime_ns, st.st_mtime_ns
    return (atime if atime <= now_ns else ctime), (mtime if mtime <= now_ns else ctime)


def is_block_name(name: str) -> bool:
    """True for ``<hex>.kv``."""
    return name.endswith(BLOCK_SUFFIX) and is_hex(name[:-len(BLOCK_SUFFIX)])


def _is_shard(name: str) -> bool:
    return len(name) == 2 and is_hex(name)


def _entry(dirent: os.DirEntry, kind: Kind, namespace: str | None) -> Entry | None:
    try:
        st = dirent.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
    atime, mtime = clamp_times(st, time.time_ns())
    return Entry(dirent.path, kind, namespace, allocated_size(st), atime, mtime,
                 stat.S_ISDIR(st.st_mode), stat.S_ISLNK(st.st_mode))


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def walk_structure(tree: KVTree) -> Iterator[Entry | LeafDir]:
    """Everything above the leaf shard dirs: classified entries and the leaf dirs themselves.

    Leaf dirs are yielded (not listed) so a caller can decide whether to list them
    (``list_leaf``) or to reuse a cached listing when their mtime is unchanged.
    """
    def descend(item: os.DirEntry) -> Iterator[Entry | LeafDir]:
        if item.name == STATE_DIR:
            return _walk_level(item.path, None, _state_kind, lambda _: iter(()))
        return _walk_namespace(item.path, item.name)

    yield from _walk_level(str(tree.root), None, _root_kind, descend)


_DESCEND = "descend"  # a directory the layout allows: walk into it
_SKIP = "skip"  # the marker, lost+found
_STATE = "state"  # .pykv: its temps and foreign entries are reported, the rest skipped


def _state_kind(item: os.DirEntry) -> Kind | str:
    name = item.name
    if name == QUARANTINE_DIR and item.is_dir(follow_symlinks=False):
        return _SKIP
    if name in STATE_FILES and item.is_file(follow_symlinks=False):
        return _SKIP
    if is_metadata_temp(name) and item.is_file(follow_symlinks=False):
        return Kind.TEMP
    return Kind.FOREIGN


def _root_kind(item: os.DirEntry) -> Kind | str:
    name = item.name
    if name == STATE_DIR and item.is_dir(follow_symlinks=False):
        return _STATE
    if name in ROOT_EXEMPT or (name == MARKER_NAME and item.is_file(follow_symlinks=False)):
        return _SKIP
    if is_metadata_temp(name) and item.is_file(follow_symlinks=False):
        return Kind.TEMP
    return _DESCEND if is_hex(name) and item.is_dir(follow_symlinks=False) else Kind.FOREIGN


def _namespace_kind(item: os.DirEntry) -> Kind | str:
    name = item.name
    if name == NAMESPACE_FILE and item.is_file(follow_symlinks=False):
        return Kind.METADATA
    if is_metadata_temp(name) and item.is_file(follow_symlinks=False):
        return Kind.TEMP
    return _DESCEND if _is_shard(name) and item.is_dir(follow_symlinks=False) else Kind.FOREIGN


def _walk_level(path: str, namespace: str | None, kind_of: Callable[[os.DirEntry], Kind | str],
                descend: Callable[[os.DirEntry], Iterator[Entry | LeafDir]]) -> Iterator[Entry | LeafDir]:
    for item in _scandir(path):
        kind = kind_of(item)
        if kind == _DESCEND or kind == _STATE:
            yield from descend(item)
        elif kind != _SKIP:
            entry = _entry(item, kind, namespace)
            if entry is not None:
                yield entry


def _walk_namespace(path: str, namespace: str) -> Iterator[Entry | LeafDir]:
    yield from _walk_level(path, namespace, _namespace_kind, lambda item: _walk_upper_shard(item.path, namespace))


def _walk_upper_shard(path: str, namespace: str) -> Iterator[Entry | LeafDir]:
    for item in _scandir(path):
        if _is_shard(item.name) and item.is_dir(follow_symlinks=False):
            try:
                yield LeafDir(item.path, namespace, item.stat(follow_symlinks=False).st_mtime_ns)
            except FileNotFoundError:
                continue
        else:
            entry = _entry(item, Kind.FOREIGN, namespace)
            if entry is not None:
                yield entry


def list_leaf(leaf: LeafDir) -> list[Entry]:
    """Classified entries of one leaf shard dir (stat of each, symlinks not followed)."""
    found: list[Entry] = []
    for item in _scandir(leaf.path):
        name = item.name
        if is_block_name(name) and item.is_file(follow_symlinks=False):
            kind = Kind.BLOCK
        elif is_temp_name(name) and item.is_file(follow_symlinks=False):
            kind = Kind.TEMP
        else:
            kind = Kind.FOREIGN
        entry = _entry(item, kind, leaf.namespace)
        if entry is not None:
            found.append(entry)
    return found


def walk(tree: KVTree) -> Iterator[Entry]:
    """Every entry of the tree, classified, listing every directory (no cache)."""
    for item in walk_structure(tree):
        if isinstance(item, LeafDir):
            yield from list_leaf(item)
        else:
            yield item


@dataclass
class Scan:
    """The entries found by one scan, and how much listing it took."""

    started_ns: int
    entries: list[Entry] = field(default_factory=list)
    dirs_listed: int = 0
    dirs_cached: int = 0

    @classmethod
    def of(cls, tree: KVTree) -> "Scan":
        """A full scan that lists every directory (no catalog)."""
        result = cls(started_ns=time.time_ns())
        with collector_paused():
            for item in walk_structure(tree):
                if isinstance(item, LeafDir):
                    result.entries.extend(list_leaf(item))
                    result.dirs_listed += 1
                else:
                    result.entries.append(item)
        return result

    def of_kind(self, kind: Kind) -> list[Entry]:
        return [e for e in self.entries if e.kind is kind]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a scan allocates a million tuples.

    The entries hold no reference cycles, yet each allocation burst triggers full
    collections that re-walk every live entry: pausing cuts a 1 M-file scan by a third.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def relative(tree: KVTree, path: str | Path) -> str:
    """``path`` relative to the tree root (for reports and the catalog)."""
    return os.path.relpath(path, tree.root)
