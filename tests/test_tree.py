"""The hash-addressed tree: marker, layout, publication, access stamps, modes (pykv/tree.py)."""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path

import pytest

from pykv.blockfile import write_block
from pykv.errors import NotATreeError, RootError
from pykv.format import Geometry
from pykv.namespace import Namespace
from pykv.roots import create_root
from pykv.tree import MARKER_NAME, NAMESPACE_FILE, KVTree, TreeOptions, check_tree_root, is_hex, is_temp_name

NS = Namespace(model="m", dtype="bfloat16", kv_layout="NHD", tokens_per_block=16)
KEY = bytes.fromhex("a1b2c3d4e5f60718293a4b5c6d7e8f90")


@pytest.fixture
def tree(tmp_path: Path) -> KVTree:
    return KVTree.create(tmp_path / "tree")


def write_temp(tree: KVTree, final: Path, content: bytes = b"x") -> Path:
    tree.ensure_parent(final)
    temp = tree.temp_path(final)
    temp.write_bytes(content)
    return temp


# -- marker ------------------------------------------------------------------------------------

def test_create_makes_marker_and_open_accepts_it(tmp_path):
    root = tmp_path / "a" / "tree"
    created = KVTree.create(root)
    marker = json.loads((root / MARKER_NAME).read_text())
    assert marker["format_version"] == 1
    assert marker["created_by"].startswith("pykv ")
    assert created.root == root
    assert KVTree.open(root).root == root
    assert [p.name for p in root.iterdir()] == [MARKER_NAME]  # no temp left


def test_create_twice_keeps_the_first_marker(tmp_path):
    root = tmp_path / "tree"
    KVTree.create(root)
    first = (root / MARKER_NAME).read_bytes()
    KVTree.create(root)
    assert (root / MARKER_NAME).read_bytes() == first


def test_open_missing_directory(tmp_path):
    root = tmp_path / "missing"
    with pytest.raises(NotATreeError, match="no such directory") as info:
        KVTree.open(root)
    assert str(root) in str(info.value)


def test_open_directory_without_marker(tmp_path):
    with pytest.raises(NotATreeError, match=MARKER_NAME) as info:
        KVTree.open(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("content", ["{not json", "", "\xff"])
def test_open_bad_json_marker(tmp_path, content):
    (tmp_path / MARKER_NAME).write_text(content, encoding="latin-1")
    with pytest.raises(NotATreeError, match="unreadable") as info:
        KVTree.open(tmp_path)
    assert str(tmp_path / MARKER_NAME) in str(info.value)


@pytest.mark.parametrize("content", ['{"format_version": 2}', '{"format_version": "1"}', "{}", "[1]", "1"])
def test_open_wrong_format_version(tmp_path, content):
    (tmp_path / MARKER_NAME).write_text(content)
    with pytest.raises(NotATreeError, match="format_version") as info:
        KVTree.open(tmp_path)
    assert str(tmp_path / MARKER_NAME) in str(info.value)


# -- layout ------------------------------------------------------------------------------------

def test_block_path_layout(tree):
    path = tree.block_path(NS.id, KEY)
    assert path == tree.root / NS.id / "a1" / "b2" / f"{KEY.hex()}.kv"


def test_block_path_of_one_byte_key_pads_second_shard(tree):
    assert tree.block_path(NS.id, b"\x7f") == tree.root / NS.id / "7f" / "00" / "7f.kv"


@pytest.mark.parametrize("bad", ["", "ABCDEF", "../etc", "abc/def", "xyz", "0a 1b", NS.id + "/..",
                                 NS.id + "\n"])
def test_namespace_dir_rejects_non_hex(tree, bad):
    with pytest.raises(ValueError, match="hex"):
        tree.namespace_dir(bad)
    with pytest.raises(ValueError, match="hex"):
        tree.block_path(bad, KEY)


def test_is_hex():
    assert is_hex("0123456789abcdef")
    assert not is_hex("")
    assert not is_hex("ABC")
    assert not is_hex("abc\n")  # "$" would match before a trailing newline


def test_temp_path_is_beside_final_and_recognised(tree):
    final = tree.block_path(NS.id, KEY)
    temp = tree.temp_path(final)
    other = tree.temp_path(final)
    assert temp.parent == final.parent
    assert temp.name.startswith(final.name)
    assert temp != other
    assert is_temp_name(temp.name)
    assert not is_temp_name(final.name)
    assert not is_temp_name(NAMESPACE_FILE)
    assert not is_temp_name("abc.tmp.host.1.ff")  # not a block's temp


def test_namespaces_lists_hex_directories_only(tree):
    tree.ensure_namespace(NS)
    (tree.root / "not-hex").mkdir()
    tree.state_dir.mkdir()
    assert list(tree.namespaces()) == [tree.root / NS.id]


# -- publication -------------------------------------------------------------------------------

def test_publish_first_wins_second_loses_and_temps_are_removed(tree):
    tree.ensure_namespace(NS)
    final = tree.block_path(NS.id, KEY)
    first = write_temp(tree, final, b"first")
    second = write_temp(tree, final, b"second")
    assert tree.publish(first, final) is True
    assert not first.exists()
    assert tree.publish(second, final) is False
    assert not second.exists()
    assert final.read_bytes() == b"first"
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]


def test_publish_with_fsync(tmp_path):
    tree = KVTree.create(tmp_path / "tree", TreeOptions(fsync=True))
    tree.ensure_namespace(NS)
    final = tree.block_path(NS.id, KEY)
    assert tree.publish(write_temp(tree, final), final) is True
    assert final.exists()


def swap_for_a_link(directory: Path, outside: Path, names: list[str]) -> Path:
    """The race a publication loses to: ``directory`` (holding a written temp) moved away and a
    link to ``outside`` put in its place, where files of ``names`` wait (not pykv's)."""
    outside.mkdir(parents=True)
    for name in names:
        (outside / name).write_bytes(b"not pykv's")
    directory.rename(directory.with_name(directory.name + ".moved"))
    directory.symlink_to(outside)
    return outside


def test_a_publication_after_its_directory_became_a_link_acts_on_nothing_outside(tree, tmp_path):
    tree.ensure_namespace(NS)
    final = tree.block_path(NS.id, KEY)
    temp = write_temp(tree, final, b"pykv's")
    outside = swap_for_a_link(final.parent, tmp_path / "outside", [temp.name])
    with pytest.raises(OSError) as raised:
        tree.publish(temp, final)
    assert raised.value.errno == errno.ELOOP
    assert sorted(p.name for p in outside.iterdir()) == [temp.name]  # no link made there, nothing removed
    assert (outside / temp.name).read_bytes() == b"not pykv's"


def test_abandoning_a_temp_after_its_directory_became_a_link_removes_nothing_outside(tmp_path):
    from pykv.media import PosixMedium
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    final = tree.block_path(NS.id, KEY)
    temp = write_temp(tree, final)
    outside = swap_for_a_link(final.parent, tmp_path / "outside", [temp.name])
    PosixMedium(tree, direct=False).abandon(temp)
    assert (outside / temp.name).read_bytes() == b"not pykv's"


def test_contains(tree):
    tree.ensure_namespace(NS)
    assert not tree.contains(NS.id, KEY)
    final = tree.block_path(NS.id, KEY)
    tree.publish(write_temp(tree, final), final)
    assert tree.contains(NS.id, KEY)
    assert not tree.contains(NS.id, KEY[:-1])


@pytest.mark.parametrize("key", [b"\x01", b"\xab\xcd", bytes(range(32))])
def test_contains_looks_exactly_at_block_path(tree, key):
    tree.ensure_namespace(NS)
    final = tree.block_path(NS.id, key)
    assert not tree.contains(NS.id, key)
    tree.publish(write_temp(tree, final), final)
    assert tree.contains(NS.id, key)
    with pytest.raises(ValueError):
        tree.contains("Not-Hex", key)


def test_contains_is_false_for_a_symlink_at_the_final_name(tree, tmp_path):
    tree.ensure_namespace(NS)
    final = tree.block_path(NS.id, KEY)
    tree.ensure_parent(final)
    target = tmp_path / "elsewhere.kv"
    target.write_bytes(b"not a block")
    final.symlink_to(target)
    assert final.exists()  # the link resolves ...
    assert not tree.contains(NS.id, KEY)  # ... but is not a block


def test_contains_is_false_for_a_directory_at_the_final_name(tree):
    tree.ensure_namespace(NS)
    final = tree.block_path(NS.id, KEY)
    final.mkdir(parents=True)
    assert not tree.contains(NS.id, KEY)


# -- access stamps -----------------------------------------------------------------------------

def test_touch_sets_atime_to_now_and_keeps_mtime(tree):
    path = tree.root / "file"
    path.write_bytes(b"x")
    old = 1_000_000_000 * 10**9  # 2001
    os.utime(path, ns=(old, old + 5))
    before = time.time_ns()
    assert tree.touch(path) is True
    st = os.stat(path)
    assert st.st_mtime_ns == old + 5
    assert before - 2 * 10**9 <= st.st_atime_ns <= time.time_ns() + 2 * 10**9


def test_touch_missing_file_returns_false(tree):
    assert tree.touch(tree.root / "gone.kv") is False


OLD_NS = 1_000_000_000 * 10**9  # 2001


def planted_block(tree: KVTree, content: bytes = b"x") -> Path:
    """The block file of (NS, KEY), its times set to 2001."""
    path = tree.block_path(NS.id, KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    os.utime(path, ns=(OLD_NS, OLD_NS + 5))
    return path


def test_stamp_sets_a_blocks_atime_to_now_and_keeps_its_mtime_also_below_a_linked_root(tmp_path):
    real = tmp_path / "real"
    KVTree.create(real)
    (tmp_path / "link").symlink_to(real)
    tree = KVTree.open(tmp_path / "link")  # a link above the root is the admin's: followed
    path = planted_block(tree)
    assert tree.stamp(NS.id, KEY) is True
    st = os.stat(path)
    assert st.st_mtime_ns == OLD_NS + 5 and st.st_atime_ns > time.time_ns() - 60 * 10**9
    assert tree.stamp(NS.id, bytes(16)) is False  # not there


@pytest.mark.parametrize("planted", ["shard-link", "namespace-link", "block-link"])
def test_stamp_never_reaches_outside_the_tree_through_a_planted_link(tree, tmp_path, planted):
    outside = tmp_path / "outside"
    victim = outside / KEY.hex()[:2] / KEY.hex()[2:4] / tree.block_path(NS.id, KEY).name
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"not pykv's")
    os.utime(victim, ns=(OLD_NS, OLD_NS))
    path = tree.block_path(NS.id, KEY)
    if planted == "namespace-link":
        path.parents[2].symlink_to(outside)  # <root>/<namespace> -> outside
    elif planted == "shard-link":
        path.parents[1].parent.mkdir(parents=True)
        path.parents[1].symlink_to(outside / KEY.hex()[:2])  # <root>/<namespace>/<ab> -> outside/ab
    else:
        path.parent.mkdir(parents=True)
        path.symlink_to(victim)
    assert tree.stamp(NS.id, KEY) is False
    assert tree.touch(path) is False  # the same rules by path
    assert os.stat(victim).st_atime_ns == OLD_NS  # untouched


def test_touch_refuses_a_path_outside_the_tree(tree, tmp_path):
    from pykv.io.safe_paths import UnsafePathError
    outside = tmp_path / "outside.kv"
    outside.write_bytes(b"x")
    os.utime(outside, ns=(OLD_NS, OLD_NS))
    for path in (outside, tree.root / ".." / "outside.kv"):
        with pytest.raises(UnsafePathError):
            tree.touch(path)
    assert os.stat(outside).st_atime_ns == OLD_NS


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_stamp_of_a_fifo_or_directory_at_a_block_name_is_false_at_once(tree, kind):
    path = tree.block_path(NS.id, KEY)
    path.parent.mkdir(parents=True)
    if kind == "fifo":
        os.mkfifo(path)  # an open without O_NONBLOCK would wait for a writer forever
    else:
        path.mkdir()
    os.utime(path, ns=(OLD_NS, OLD_NS))
    began = time.monotonic()
    assert tree.stamp(NS.id, KEY) is False and tree.touch(path) is False
    assert time.monotonic() - began < 5
    assert os.stat(path).st_atime_ns == OLD_NS


# -- modes and namespace description -------------------------------------------------------------

def test_default_modes_are_private(tmp_path):
    previous = os.umask(0)
    try:
        tree = KVTree.create(tmp_path / "tree")
        tree.ensure_namespace(NS)
        assert write_block(tree, NS.id, KEY, Geometry(16, 1, 100), bytes(100)) is True
    finally:
        os.umask(previous)
    final = tree.block_path(NS.id, KEY)

    def mode(path: Path) -> int:
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(final) == 0o600
    assert mode(tree.root / MARKER_NAME) == 0o600
    assert mode(tree.root / NS.id / NAMESPACE_FILE) == 0o600
    for directory in (tree.root, tree.root / NS.id, final.parent.parent, final.parent):
        assert mode(directory) == 0o700, directory


def test_custom_modes_are_used(tmp_path):
    previous = os.umask(0)
    try:
        tree = KVTree.create(tmp_path / "tree", TreeOptions(file_mode=0o640, dir_mode=0o750))
        tree.ensure_namespace(NS)
        write_block(tree, NS.id, KEY, Geometry(16, 1, 10), bytes(10))
    finally:
        os.umask(previous)
    final = tree.block_path(NS.id, KEY)
    assert stat.S_IMODE(os.stat(final).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(final.parent).st_mode) == 0o750


def test_ensure_namespace_writes_a_description_that_round_trips(tree):
    directory = tree.ensure_namespace(NS)
    assert directory == tree.root / NS.id
    data = json.loads((directory / NAMESPACE_FILE).read_text())
    assert data["id"] == NS.id
    assert Namespace.from_description(data) == NS
    assert Namespace.from_description(data).id == NS.id
    assert [p.name for p in directory.iterdir()] == [NAMESPACE_FILE]


def test_ensure_namespace_is_idempotent(tree):
    tree.ensure_namespace(NS)
    description = tree.root / NS.id / NAMESPACE_FILE
    first = description.read_bytes()
    assert tree.ensure_namespace(NS) == tree.root / NS.id
    assert description.read_bytes() == first


# -- roots: never created by an engine ------------------------------------------------------------

def test_create_without_mkdir_needs_the_root_and_makes_nothing(tmp_path):
    for root in (tmp_path / "kv", tmp_path / "no" / "kv"):
        with pytest.raises(RootError, match=rf"^kv_connector_extra_config\.root: {root} does not exist; create it "
                                            rf"with `pykv init {root}` \(pykv never creates a root"):
            KVTree.create(root, mkdir=False)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kv").mkdir()
    assert KVTree.create(tmp_path / "kv", mkdir=False).root == tmp_path / "kv"  # an empty one becomes a tree
    assert (tmp_path / "kv" / MARKER_NAME).exists()


def test_check_tree_root_refuses_what_create_refuses_and_changes_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    check_tree_root(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    with pytest.raises(NotATreeError, match="holds files"):
        check_tree_root(tmp_path / "full", "--root")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MARKER_NAME).write_text("{")
    with pytest.raises(NotATreeError, match="unreadable tree marker"):
        check_tree_root(tmp_path / "bad")
    with pytest.raises(RootError, match="^--root: .* does not exist"):
        check_tree_root(tmp_path / "missing", "--root")


def test_create_root_makes_one_directory_never_its_parents(tmp_path):
    assert create_root(tmp_path / "kv", field="ROOT") is True
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert create_root(tmp_path / "kv", field="ROOT") is False  # already there
    with pytest.raises(RootError, match=r"^ROOT: the parent of .*no/kv is not an existing directory; pykv init makes "
                                        r"one directory, never its parents"):
        create_root(tmp_path / "no" / "kv", field="ROOT")
    (tmp_path / "file").write_text("x")
    for root, reason in ((tmp_path / "file", "is not a directory"), (tmp_path / "file" / "kv", "parent of")):
        with pytest.raises(RootError, match=reason):
            create_root(root, field="ROOT")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "kv"]
