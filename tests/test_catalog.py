from __future__ import annotations

import os

from treefactory import add_block, age_dirs, key, make_tree

from pykv.maintenance.catalog import CATALOG_NAME, Catalog, scan_tree
from pykv.maintenance.scan import Kind, Scan


def summary(scan):
    return sorted((e.path, e.kind, e.size, e.mtime_ns) for e in scan.entries)


def test_warm_scan_reuses_unchanged_dirs_and_matches_a_full_scan(tmp_path):
    tree = make_tree(tmp_path)
    for i in range(20):
        add_block(tree, bytes([i * 11]) + key(i))
    age_dirs(tree)
    with Catalog(tree) as catalog:
        cold = catalog.scan()
        warm = catalog.scan()
    assert cold.dirs_cached == 0 and cold.dirs_listed == 20
    assert warm.dirs_cached == 20 and warm.dirs_listed == 0
    assert summary(warm) == summary(cold) == summary(Scan.of(tree))
    assert (tree.state_dir / CATALOG_NAME).is_file()


def test_changed_dirs_are_listed_again(tmp_path):
    tree = make_tree(tmp_path)
    first = add_block(tree, key(1))
    second = add_block(tree, key(2))  # same leaf dir as key(1)
    assert first.parent == second.parent
    age_dirs(tree)
    with Catalog(tree) as catalog:
        catalog.scan()
        first.unlink()
        third = add_block(tree, key(3))
        warm = catalog.scan()
    assert warm.dirs_listed == 1
    assert sorted(e.path for e in warm.of_kind(Kind.BLOCK)) == sorted([str(second), str(third)])


def test_racy_dirs_are_not_trusted(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))  # leaf dir modified just now
    with Catalog(tree) as catalog:
        catalog.scan()
        assert catalog.scan().dirs_listed == 1


def test_removed_dirs_leave_the_catalog(tmp_path):
    tree = make_tree(tmp_path)
    path = add_block(tree, key(1))
    age_dirs(tree)
    with Catalog(tree) as catalog:
        catalog.scan()
        path.unlink()
        path.parent.rmdir()
        assert catalog.scan().entries == [e for e in Scan.of(tree).entries]
        assert catalog.db["entries"].count == 0


def test_cached_atime_is_a_lower_bound(tmp_path):
    tree = make_tree(tmp_path)
    path = add_block(tree, key(1), accessed_ago=1000)
    age_dirs(tree)
    with Catalog(tree) as catalog:
        before = catalog.scan().of_kind(Kind.BLOCK)[0].atime_ns
        tree.touch(path)
        cached = catalog.scan().of_kind(Kind.BLOCK)[0].atime_ns
    assert cached == before < os.stat(path).st_atime_ns


def test_unusable_catalog_falls_back_to_a_plain_scan(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))
    tree.state_dir.mkdir()
    (tree.state_dir / CATALOG_NAME).write_bytes(b"not a database" * 100)
    result = scan_tree(tree)
    assert len(result.of_kind(Kind.BLOCK)) == 1


def test_schema_version_mismatch_rebuilds(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))
    with Catalog(tree) as catalog:
        catalog.scan()
        catalog.db.execute("PRAGMA user_version = 99")
    with Catalog(tree) as catalog:
        assert catalog.db["entries"].count == 0
        assert len(catalog.scan().of_kind(Kind.BLOCK)) == 1


def planted(tree, statements: list[str], version: int = 1) -> None:
    """A catalog with the right tables and version, and SQL someone else added."""
    import sqlite3
    with Catalog(tree) as catalog:
        catalog.scan()
    conn = sqlite3.connect(tree.state_dir / CATALOG_NAME)
    for statement in statements:
        conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {version}")
    conn.commit()
    conn.close()


def schema_of(tree) -> list[tuple]:
    import sqlite3
    conn = sqlite3.connect(tree.state_dir / CATALOG_NAME)
    try:
        return sorted(conn.execute("SELECT type, name FROM sqlite_master").fetchall())
    finally:
        conn.close()


def test_a_planted_trigger_never_fires_and_is_dropped(tmp_path):
    """A trigger in the catalog (a cross join that would run for hours, here one that leaves a
    trace) is dropped before any row is written: the scan lists the tree, the trigger never ran."""
    tree = make_tree(tmp_path)
    for i in range(3):
        add_block(tree, bytes([i * 40]) + key(i))
    planted(tree, ["CREATE TABLE trace (n)",
                   "CREATE TRIGGER planted AFTER INSERT ON leaf_dirs BEGIN INSERT INTO trace VALUES (1); END",
                   "CREATE TRIGGER planted2 AFTER INSERT ON entries BEGIN INSERT INTO trace VALUES (2); END",
                   "DELETE FROM leaf_dirs", "DELETE FROM entries"])
    os.utime(tree.root / os.listdir(tree.root)[0], None)  # any dir listed again: rows are inserted
    result = scan_tree(tree)
    assert len(result.of_kind(Kind.BLOCK)) == 3
    assert [name for kind, name in schema_of(tree) if kind != "index"] == ["entries", "leaf_dirs"]


def test_views_and_other_objects_in_place_of_the_tables_are_rebuilt(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))
    planted(tree, ["DROP TABLE leaf_dirs", "CREATE VIEW leaf_dirs AS SELECT 1 AS dir, 2 AS namespace, 3 AS mtime_ns",
                   "CREATE INDEX heavy ON entries (zeroblob(100000000))"])
    for version in (1, 7):
        with Catalog(tree) as catalog:  # no AttributeError, no 100 MB per row
            assert len(catalog.scan().of_kind(Kind.BLOCK)) == 1
        assert sorted(name for kind, name in schema_of(tree) if kind == "table") == ["entries", "leaf_dirs"]
        assert not [name for kind, name in schema_of(tree) if kind in ("view", "trigger") or name == "heavy"]
        planted(tree, ["CREATE VIEW v AS SELECT 1"], version=version + 1)


def test_a_column_pykv_never_made_rebuilds_the_catalog(tmp_path):
    tree = make_tree(tmp_path)
    add_block(tree, key(1))
    planted(tree, ["ALTER TABLE entries ADD COLUMN extra DEFAULT 7"])
    with Catalog(tree) as catalog:
        assert "extra" not in catalog.db["entries"].columns_dict
        assert len(catalog.scan().of_kind(Kind.BLOCK)) == 1


def test_a_catalog_sqlite_utils_3_made_is_kept(tmp_path):
    """sqlite-utils 3 quotes names ``[dir]``, 4 ``"dir"`` (both allowed): either's catalog is kept,
    so two installs sharing a tree do not rebuild it on every run."""
    import sqlite3
    tree = make_tree(tmp_path)
    for i in range(4):
        add_block(tree, bytes([i * 50]) + key(i))
    age_dirs(tree)
    tree.state_dir.mkdir()
    conn = sqlite3.connect(tree.state_dir / CATALOG_NAME)
    conn.execute("CREATE TABLE [leaf_dirs] (\n   [dir] TEXT PRIMARY KEY,\n   [namespace] TEXT,\n   [mtime_ns] INTEGER\n)")
    conn.execute("CREATE TABLE [entries] (\n   [dir] TEXT,\n   [name] TEXT,\n   [kind] TEXT,\n   [size] INTEGER,\n"
                 "   [atime_ns] INTEGER,\n   [mtime_ns] INTEGER,\n   PRIMARY KEY ([dir], [name])\n)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with Catalog(tree) as catalog:
        assert catalog.scan().dirs_listed == 4
    with Catalog(tree) as catalog:
        assert catalog.scan().dirs_cached == 4  # not rebuilt
    assert "[entries]" in sqlite3.connect(tree.state_dir / CATALOG_NAME).execute(
        "SELECT sql FROM sqlite_master WHERE name = 'entries'").fetchone()[0]
