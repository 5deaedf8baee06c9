"""A SQLite cache of tree scans (``<root>/.pykv/catalog.db``), built with sqlite-utils.

The tree stays the truth; the catalog only saves work. It stores, per leaf shard
dir, the dir's mtime and the classified entries seen when it was last listed. A
later scan re-lists a leaf dir only when its mtime changed: creating, linking,
renaming or unlinking a file in it changes the dir's mtime, so an unchanged mtime
means an unchanged set of names, and block files are never rewritten in place,
so their size and mtime (publication time) are unchanged too.

What an unchanged dir mtime does *not* say is the atime: ``KVTree.touch`` changes
only the file. Cached atimes are therefore lower bounds (atimes only move
forward), and gc re-stats each candidate before deleting it (see ``gc.collect``).

A dir whose mtime is within ``RACY_NS`` of the moment it was listed is stored
untrusted (mtime NULL) and listed again next time: a file created in the same
timestamp tick as the listing would otherwise leave the mtime unchanged.

The catalog lies in the tree, so its rows are as untrusted as the files: a row that is not
one path component is dropped, and a leaf whose rows hold a size or a time no listing writes
(below 0 or beyond the file system's capacity; after the scan began) is listed again. Its
schema is checked too: a catalog holding any object pykv never makes (a trigger, a view, an
index, another column) is emptied and rebuilt before a row is written, so no planted SQL runs. A
catalog or journal that is a link, or a file with another hard link, is never opened.

The serving path never opens this file. Any SQLite failure (locked, corrupt,
read-only) makes ``scan_tree`` fall back to a plain walk.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sqlite3
import stat
import time
from pathlib import Path

import sqlite_utils

from pykv.io.safe_paths import check_name
from pykv.maintenance.scan import Entry, Kind, LeafDir, Scan, collector_paused, is_block_name, list_leaf, walk_structure
from pykv.tree import KVTree, is_temp_name

log = logging.getLogger(__name__)

CATALOG_NAME = "catalog.db"
SCHEMA_VERSION = 1
RACY_NS = 2_000_000_000
_KINDS = {kind.value: kind for kind in Kind}


class Catalog:
    """The scan cache of one tree. Use as a context manager or call ``close``."""

    def __init__(self, tree: KVTree, path: Path | None = None) -> None:
        self.tree = tree
        self.path = path or tree.state_dir / CATALOG_NAME
        if path is None:
            tree.ensure_state_dir()
        else:
            self.path.parent.mkdir(mode=tree.options.dir_mode, exist_ok=True)
        _refuse_links(self.path)
        try:  # SQLite would create it 0644; an empty file is an empty database (journals copy its mode)
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             tree.options.file_mode))
        except FileExistsError:
            pass
        self.db = sqlite_utils.Database(self.path)
        self.db.execute("PRAGMA busy_timeout = 10000")
        self._ensure_schema()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    def _ensure_schema(self) -> None:
        """The two tables and nothing else: a catalog of another version, or with any other object
        (a trigger, a view, an index, a table or column pykv never made), is emptied and rebuilt, so
        no SQL planted in the file runs when gc or inspect writes rows."""
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION or _schema(self.db.conn) != _expected_schema():
            _drop_everything(self.db.conn)
        _create_tables(self.db)
        if _schema(self.db.conn) != _expected_schema():  # an object SQLite would not drop (a forged sqlite_ name)
            raise sqlite3.DatabaseError("its schema holds objects pykv never makes and cannot drop")
        self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def scan(self) -> Scan:
        """Scan the tree, re-listing only leaf dirs whose mtime changed; update the cache."""
        with collector_paused():
            return self._scan()

    def _scan(self) -> Scan:
        started = time.time_ns()
        root = str(self.tree.root)
        prefix = len(root) + 1
        cached_mtime = dict(self.db.execute("SELECT dir, mtime_ns FROM leaf_dirs").fetchall())
        result = Scan(started_ns=started)
        reuse: dict[str, LeafDir] = {}
        fresh: list[tuple[LeafDir, float, list[Entry]]] = []
        for item in walk_structure(self.tree):
            if not isinstance(item, LeafDir):
                result.entries.append(item)
                continue
            rel = item.path[prefix:]  # walk paths are f"{root}/..."
            if cached_mtime.get(rel) == item.mtime_ns:
                reuse[rel] = item
            else:
                listed_at = time.time_ns()
                entries = list_leaf(item)
                result.entries.extend(entries)
                fresh.append((item, listed_at, entries))
        capacity = _capacity(self.tree.root)
        cached: dict[str, list[Entry]] = {}
        for rel, name, kind, size, atime_ns, mtime_ns in self.db.execute(
                "SELECT dir, name, kind, size, atime_ns, mtime_ns FROM entries"):
            leaf = reuse.get(rel)
            if leaf is not None:
                row_kind = _checked_kind(name, kind)
                if row_kind is None or type(size) is not int or type(atime_ns) is not int \
                        or type(mtime_ns) is not int:
                    continue  # a row pykv never wrote: the tree is the truth, the next listing sees it
                if not 0 <= size <= capacity or atime_ns > started or mtime_ns > started:
                    reuse.pop(rel)  # a size or time no listing gives (listed ones are clamped): list it again
                    cached.pop(rel, None)
                    fresh.append((leaf, time.time_ns(), entries := list_leaf(leaf)))
                    result.entries.extend(entries)
                    continue
                cached.setdefault(rel, []).append(
                    Entry(f"{leaf.path}/{name}", row_kind, leaf.namespace, size, atime_ns, mtime_ns))
        for entries in cached.values():
            result.entries.extend(entries)
        result.dirs_listed = len(fresh)
        result.dirs_cached = len(reuse)
        try:
            self._store(prefix, set(cached_mtime) - set(reuse), fresh)
        except sqlite3.Error as exc:  # the scan stands; the next one lists more
            log.warning("could not update catalog %s: %s", self.path, exc)
        return result

    def _store(self, prefix: int, stale: set[str], fresh: list[tuple[LeafDir, float, list[Entry]]]) -> None:
        conn = self.db.conn
        with conn:
            conn.executemany("DELETE FROM entries WHERE dir = ?", ((rel,) for rel in stale))
            conn.executemany("DELETE FROM leaf_dirs WHERE dir = ?", ((rel,) for rel in stale))
            dir_rows = []
            entry_rows = []
            for leaf, listed_at, entries in fresh:
                rel = leaf.path[prefix:]
                rows = [(rel, e.path[len(leaf.path) + 1:], e.kind.value, e.size, e.atime_ns, e.mtime_ns)
                        for e in entries]
                if not all(_encodable(row[1]) for row in rows):  # a name that is not UTF-8: list it each time
                    rows = []
                    trusted = False
                else:
                    trusted = leaf.mtime_ns < listed_at - RACY_NS
                dir_rows.append((rel, leaf.namespace, leaf.mtime_ns if trusted else None))
                entry_rows.extend(rows)
            conn.executemany("INSERT OR REPLACE INTO leaf_dirs (dir, namespace, mtime_ns) VALUES (?, ?, ?)",
                             dir_rows)
            conn.executemany("INSERT OR REPLACE INTO entries (dir, name, kind, size, atime_ns, mtime_ns) "
                             "VALUES (?, ?, ?, ?, ?, ?)", entry_rows)


def _encodable(name: str) -> bool:
    """Whether SQLite can store ``name`` (a file name of bytes that are not UTF-8 cannot)."""
    try:
        name.encode()
        return True
    except UnicodeEncodeError:
        return False


def _create_tables(db: sqlite_utils.Database) -> None:
    db["leaf_dirs"].create({"dir": str, "namespace": str, "mtime_ns": int}, pk="dir", if_not_exists=True)
    db["entries"].create({"dir": str, "name": str, "kind": str, "size": int, "atime_ns": int, "mtime_ns": int},
                         pk=("dir", "name"), if_not_exists=True)


def _schema(conn: sqlite3.Connection) -> list[tuple]:
    """The catalog's objects, their SQL without quoting or spacing (sqlite-utils 3 writes ``[dir]``,
    4 ``"dir"``: a catalog either made is kept)."""
    rows = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
    return sorted(((kind, name, table, None if sql is None else "".join(re.sub(r'[\[\]"]', "", str(sql)).split()))
                   for kind, name, table, sql in rows), key=lambda row: tuple(str(value) for value in row))


_EXPECTED: list[tuple] = []


def _expected_schema() -> list[tuple]:
    """The schema a fresh catalog has (built once, in memory)."""
    if not _EXPECTED:
        memory = sqlite_utils.Database(memory=True)
        _create_tables(memory)
        _EXPECTED.extend(_schema(memory.conn))
        memory.close()
    return _EXPECTED


def _drop_everything(conn: sqlite3.Connection) -> None:
    """Every object of the catalog's schema dropped (triggers and views first, so none fires)."""
    order = {"trigger": 0, "view": 1, "index": 2, "table": 3}
    objects = conn.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite\\_%' ESCAPE '\\'").fetchall()
    for kind, name in sorted(objects, key=lambda row: order.get(row[0], 4)):
        if kind in order:
            quoted = '"' + str(name).replace('"', '""') + '"'
            conn.execute(f"DROP {kind.upper()} IF EXISTS {quoted}")
    conn.commit()


def _capacity(root: Path) -> int:
    """The bytes the root's file system holds: no file there occupies more (a listing counts what a
    file occupies), so a cached row claiming more was not written by a listing."""
    try:
        st = os.statvfs(root)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def _checked_kind(name: object, kind: object) -> Kind | None:
    """The kind of a cached row, re-derived from its name: None for a name that is not one path
    component (``../x``, ``a/b``); a row may not call a name a block that is not one."""
    if kind == "block" and type(name) is str and is_block_name(name):
        return Kind.BLOCK  # the common row: ``<hex>.kv`` is one component by construction
    if not isinstance(name, str) or kind not in _KINDS:
        return None
    try:
        check_name(name)
    except OSError:
        return None
    claimed = _KINDS[kind]
    if claimed is Kind.BLOCK or (claimed is Kind.TEMP and not is_temp_name(name)):
        return Kind.FOREIGN
    return claimed


def _refuse_links(path: Path) -> None:
    """SQLite follows symlinks: a link planted as the catalog, its journals or the state dir, or a
    hard link of another file at their names, could make it rewrite any file of the user running
    gc. Raise ``OSError`` for one."""
    for candidate in (path.parent, *(path.with_name(path.name + s) for s in ("", "-journal", "-wal", "-shm"))):
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            continue
        mode = st.st_mode
        if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) if candidate == path.parent else stat.S_ISREG(mode)):
            raise OSError(errno.ELOOP, "not a plain file or directory (planted link?)", str(candidate))
        if candidate != path.parent and st.st_nlink != 1:  # SQLite would rewrite the file of the other name
            raise OSError(errno.EMLINK, "a file with another hard link, not a catalog pykv wrote", str(candidate))


def _read_only(exc: Exception) -> bool:
    if isinstance(exc, PermissionError) or getattr(exc, "errno", None) == errno.EROFS:
        return True
    return isinstance(exc, sqlite3.OperationalError) and ("readonly" in str(exc) or "unable to open" in str(exc))


def scan_tree(tree: KVTree, *, use_catalog: bool = True) -> Scan:
    """Scan ``tree``, through the catalog when ``use_catalog`` and it is usable."""
    if use_catalog:
        try:
            with Catalog(tree) as catalog:
                return catalog.scan()
        except (sqlite3.Error, OSError) as exc:
            level = logging.DEBUG if _read_only(exc) else logging.WARNING  # expected on a tree we may only read
            log.log(level, "catalog %s unusable (%s); scanning without it", tree.state_dir / CATALOG_NAME, exc)
    return Scan.of(tree)
