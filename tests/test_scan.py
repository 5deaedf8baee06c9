from __future__ import annotations

import os

from treefactory import NS, add_block, key, make_tree

from pykv.maintenance import scan
from pykv.maintenance.scan import Kind, Scan, walk


def kinds(tree):
    return {os.path.relpath(e.path, tree.root): e.kind for e in walk(tree)}


def test_walk_classifies_every_place(tmp_path):
    tree = make_tree(tmp_path)
    block = add_block(tree, key(1))
    temp = tree.temp_path(block)
    temp.write_bytes(b"partial")
    ns_dir = tree.namespace_dir(NS.id)
    (ns_dir / "namespace.json.tmp.host.1.ab").write_text("{}")
    (tree.root / "README").write_text("x")
    (tree.root / "not-hex").mkdir()
    (tree.root / "lost+found").mkdir()
    (tree.state_dir).mkdir()
    (tree.state_dir / "catalog.db").write_text("")
    (ns_dir / "stray.txt").write_text("x")
    (ns_dir / "zz").mkdir()
    (block.parent.parent / "file-in-upper-shard").write_text("x")
    (block.parent / "deadbeef.txt").write_text("x")
    (block.parent / "abcd.kv").mkdir()
    (block.parent / "beef.kv").symlink_to(block)
    found = kinds(tree)
    rel = lambda p: os.path.relpath(p, tree.root)  # noqa: E731
    assert found.pop(rel(block)) is Kind.BLOCK
    assert found.pop(rel(temp)) is Kind.TEMP
    assert found.pop(f"{NS.id}/namespace.json.tmp.host.1.ab") is Kind.TEMP
    assert found.pop(f"{NS.id}/namespace.json") is Kind.METADATA
    assert set(found.values()) == {Kind.FOREIGN}
    assert set(found) == {"README", "not-hex", f"{NS.id}/stray.txt", f"{NS.id}/zz",
                          rel(block.parent.parent / "file-in-upper-shard"), rel(block.parent / "deadbeef.txt"),
                          rel(block.parent / "abcd.kv"), rel(block.parent / "beef.kv")}


def test_symlinks_are_foreign_and_not_followed(tmp_path):
    tree = make_tree(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "00" / "00").mkdir(parents=True)
    (outside / "00" / "00" / "aa.kv").write_text("x")
    (tree.namespace_dir(NS.id) / "00").symlink_to(outside / "00")
    entries = list(walk(tree))
    assert sorted((e.kind.value, e.is_symlink) for e in entries if e.namespace) == [("foreign", True), ("metadata", False)]


def test_entries_carry_stat_of_the_file(tmp_path):
    tree = make_tree(tmp_path)
    path = add_block(tree, key(1), published_ago=100, accessed_ago=10)
    (entry,) = Scan.of(tree).of_kind(Kind.BLOCK)
    st = os.stat(path)
    assert (entry.size, entry.atime_ns, entry.mtime_ns, entry.namespace) == \
        (st.st_size, st.st_atime_ns, st.st_mtime_ns, NS.id)


def test_files_vanishing_mid_scan_are_skipped(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    keep, gone = add_block(tree, key(1)), add_block(tree, key(2))
    real = scan._scandir

    def listing_then_delete(path):
        entries = real(path)
        if gone.parent == type(gone)(path):
            gone.unlink()
        return entries

    monkeypatch.setattr(scan, "_scandir", listing_then_delete)
    assert [e.path for e in walk(tree) if e.kind is Kind.BLOCK] == [str(keep)]


def test_vanished_directory_is_empty(tmp_path):
    assert scan._scandir(str(tmp_path / "missing")) == []


def test_scan_counts_listed_dirs(tmp_path):
    tree = make_tree(tmp_path)
    for i in range(3):
        add_block(tree, bytes([i * 40]) * 4)
    result = Scan.of(tree)
    assert result.dirs_listed == 3 and len(result.of_kind(Kind.BLOCK)) == 3
