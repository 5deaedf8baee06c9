"""Adversarial tests for the tree's metadata (docs/adversarial-matrix.md): the marker,
``namespace.json``, the scan catalog, the quarantine and the modes, attacked where no earlier
test did.

Each test here attacks one promise of docs/security.md, docs/reliability.md or
docs/deployment.md; those marked *found* in the matrix failed on the code before their fix:
JSON nested deeper than Python's stack in a marker (a ``RecursionError`` traceback from every
command), a ``namespace.json`` field nested hundreds deep (``inspect`` crashed printing it), a
catalog hard-linked to a database outside the root (gc dropped its tables), and catalog rows
with sizes or times no listing writes (one fake row made gc delete every block).
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pykv.blockfile import write_block
from pykv.commands.app import app
from pykv.commands.output import parse_pairs
from pykv.deviceset import DeviceSet
from pykv.errors import NotATreeError
from pykv.format import Geometry
from pykv.maintenance import run_gc
from pykv.maintenance.catalog import CATALOG_NAME, scan_tree
from pykv.tree import MARKER_NAME, NAMESPACE_FILE, KVTree, TreeOptions

from reliability.deadline import deadline
from reliability.rig import NS, key_of, payload_of

GEOMETRY = Geometry(tokens=256, segments=1, segment_bytes=8192)
OLD_NS = 1_000_000_000 * 10**9  # 2001
DEEP = {"array": "[" * 5000, "object": '{"a":' * 5000}  # past Python's recursion limit


def nested(depth: int) -> str:
    """A JSON value nested ``depth`` deep: it parses when the stack has room, and printing it
    recurses as deep (the depth that breaks depends on the stack at the parse: several are tried)."""
    return "[" * depth + "]" * depth


def run(*argv: object):
    with deadline(30):
        return CliRunner().invoke(app, [str(a) for a in argv])


def one_error_line(result, naming: str) -> bool:
    return (result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("pykv: error: ")
            and naming in result.stderr and "Traceback" not in result.output and result.stdout == "")


def tree_with_blocks(root: Path, count: int = 4, options: TreeOptions | None = None) -> tuple[KVTree, list[Path]]:
    tree = KVTree.create(root, options)
    tree.ensure_namespace(NS)
    paths = []
    for i in range(count):
        write_block(tree, NS.id, key_of(i), GEOMETRY, payload_of(key_of(i), GEOMETRY.payload_length))
        path = tree.block_path(NS.id, key_of(i))
        os.utime(path, ns=(OLD_NS, OLD_NS))
        paths.append(path)
    for path in paths:  # old leaf dirs: the catalog trusts their listing
        os.utime(path.parent, ns=(OLD_NS, OLD_NS))
    return tree, paths


# -- the marker ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["inspect"], ["gc", "--max-size", "0"], ["fsck"], ["init"], ["config", "--root"]])
@pytest.mark.parametrize("shape", list(DEEP))
def test_a_marker_nested_deeper_than_the_stack_is_one_line(tmp_path, shape, command):
    """Found: every command died with a RecursionError traceback (exit 1)."""
    tree, paths = tree_with_blocks(tmp_path / "tree", 1)
    (tree.root / MARKER_NAME).write_text(DEEP[shape])
    result = run(*command, tree.root)
    assert one_error_line(result, f"{MARKER_NAME}: unreadable tree marker (JSON nested too deeply)"), result.output
    assert paths[0].exists()


@pytest.mark.parametrize("shape", list(DEEP))
def test_an_engine_refuses_a_marker_nested_deeper_than_the_stack_with_a_typed_error(tmp_path, shape):
    tree, _ = tree_with_blocks(tmp_path / "tree", 1)
    (tree.root / MARKER_NAME).write_text(DEEP[shape])
    with pytest.raises(NotATreeError, match="nested too deeply"):
        DeviceSet.create([tree.root])


def test_doctor_fails_a_deeply_nested_marker_without_a_traceback(tmp_path):
    tree, _ = tree_with_blocks(tmp_path / "tree", 1)
    (tree.root / MARKER_NAME).write_text(DEEP["array"])
    result = run("doctor", tree.root)
    assert result.exit_code == 1 and "Traceback" not in result.output and "nested too deeply" in result.output


@pytest.mark.parametrize("command", [["inspect"], ["gc", "--max-size", "0"], ["fsck"], ["init"], ["config", "--root"]])
def test_a_sparse_terabyte_marker_is_never_read(tmp_path, command):
    tree, paths = tree_with_blocks(tmp_path / "tree", 1)
    with open(tree.root / MARKER_NAME, "r+b") as marker:
        marker.truncate(1 << 40)
    result = run(*command, tree.root)
    assert one_error_line(result, "more than the 1048576 allowed here"), result.output
    assert paths[0].exists()


def plant_marker(root: Path, kind: str, other: Path) -> None:
    marker = root / MARKER_NAME
    os.unlink(marker)
    if kind == "symlink":
        marker.symlink_to(other / MARKER_NAME)  # another tree's sound marker
    elif kind == "fifo":
        os.mkfifo(marker)
    elif kind == "device":
        os.mknod(marker, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    elif kind == "directory":
        marker.mkdir()
        (marker / "inside").write_text("someone's data")


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device", "directory"])
def test_an_engine_init_and_config_refuse_a_marker_that_is_no_file_at_once(tmp_path, kind):
    tree, paths = tree_with_blocks(tmp_path / "tree", 1)
    other = KVTree.create(tmp_path / "other")
    plant_marker(tree.root, kind, other.root)
    with deadline(10), pytest.raises(NotATreeError, match="unreadable tree marker"):
        DeviceSet.create([tree.root])
    for command in (["init"], ["config", "--root"]):
        assert one_error_line(run(*command, tree.root), "unreadable tree marker")
    result = run("doctor", tree.root)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert paths[0].exists() and os.path.lexists(tree.root / MARKER_NAME)


# -- namespace.json -----------------------------------------------------------------------------
NAMESPACE_JSON = {
    **{f"nested-model-{d}": '{"model": ' + nested(d) + ', "dtype": "bfloat16", "tokens_per_block": 256}'
       for d in (300, 500, 700, 900)},
    **{f"nested-extra-{d}": '{"model": "m", "dtype": "bf16", "tokens_per_block": 256, "extra": {"seed": '
       + nested(d) + "}}" for d in (300, 500, 700, 900)},
    "too-deep": "[" * 5000,
    "not-utf8": b'{"model": "\xff\xfe", "dtype": 1}',
    "sparse-terabyte": None,
}


@pytest.mark.parametrize("case", list(NAMESPACE_JSON))
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_inspect_survives_any_namespace_json(tmp_path, case, json_flag):
    """Found (nested-*): inspect crashed with a RecursionError printing the field."""
    tree, _ = tree_with_blocks(tmp_path / "tree", 1)
    path = tree.namespace_dir(NS.id) / NAMESPACE_FILE
    content = NAMESPACE_JSON[case]
    if content is None:
        with open(path, "r+b") as f:
            f.truncate(1 << 40)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = run("inspect", tree.root, *json_flag)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert NS.id[:12] in result.stdout


# -- the scan catalog ---------------------------------------------------------------------------
def test_a_catalog_hard_linked_to_a_database_outside_is_never_written(tmp_path):
    """Found: SQLite opened the other name's database and gc dropped its tables."""
    tree, paths = tree_with_blocks(tmp_path / "tree")
    outside = tmp_path / "users.db"
    with sqlite3.connect(outside) as db:
        db.execute("CREATE TABLE precious (x)")
        db.execute("INSERT INTO precious VALUES (42)")
    db.close()
    before = outside.read_bytes()
    tree.ensure_state_dir()
    os.link(outside, tree.state_dir / CATALOG_NAME)
    result = run("gc", tree.root, "--max-size", "1G")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert outside.read_bytes() == before and all(path.exists() for path in paths)
    assert os.lstat(outside).st_nlink == 2  # left where it was for a person to decide


@pytest.mark.parametrize("journal", ["-journal", "-wal"])
def test_a_catalog_journal_hard_linked_from_outside_is_never_written(tmp_path, journal):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep me")
    tree.ensure_state_dir()
    os.link(outside, tree.state_dir / (CATALOG_NAME + journal))
    result = run("gc", tree.root, "--max-size", "1G")
    assert result.exit_code == 0 and outside.read_bytes() == b"keep me" and all(p.exists() for p in paths)


def _forge_rows(tree: KVTree, forge) -> None:
    """Build the catalog with a full scan, then let ``forge(db, trusted_dir)`` change its rows."""
    run_gc(tree, max_size=1 << 40, min_age_s=0)
    db = sqlite3.connect(tree.state_dir / CATALOG_NAME)
    (trusted,) = db.execute("SELECT dir FROM leaf_dirs WHERE mtime_ns IS NOT NULL LIMIT 1").fetchone()
    forge(db, trusted)
    db.commit()
    db.close()


FORGERIES = {
    "a petabyte block that is not there": lambda db, d: db.execute(
        "INSERT INTO entries VALUES (?, ?, 'block', ?, ?, ?)", (d, "f" * 40 + ".kv", 1 << 50, time.time_ns(), OLD_NS)),
    "a petabyte of junk": lambda db, d: db.execute(
        "INSERT INTO entries VALUES (?, 'junk', 'foreign', ?, ?, ?)", (d, 1 << 50, OLD_NS, OLD_NS)),
    "negative sizes": lambda db, d: db.execute("UPDATE entries SET size = -100000000"),
    "atimes in 2100": lambda db, d: db.execute("UPDATE entries SET atime_ns = ?", (4_102_444_800 * 10**9,)),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_catalog_rows_no_listing_writes_never_make_gc_delete_more(tmp_path, forgery):
    """Found: a petabyte row made gc delete every block; negative sizes hid the tree's size."""
    tree, paths = tree_with_blocks(tmp_path / "tree")
    _forge_rows(tree, FORGERIES[forgery])
    truth = sorted((e.path, e.size) for e in scan_tree(tree, use_catalog=False).entries)
    assert sorted((e.path, e.size) for e in scan_tree(tree).entries) == truth
    real = sum(path.stat().st_size for path in paths)
    result = run("gc", tree.root, "--max-size", str(2 * real), "--min-age", "0")
    assert result.exit_code == 0, result.output
    assert all(path.exists() for path in paths)


def test_a_future_atime_in_the_catalog_does_not_make_a_block_recent_forever(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    newest = paths[-1]
    os.utime(newest, ns=(OLD_NS + 10**9, OLD_NS))  # the truth: the last block is the most recent
    run_gc(tree, max_size=1 << 40, min_age_s=0)  # a catalog listing the truth
    future = 4_102_444_800 * 10**9
    db = sqlite3.connect(tree.state_dir / CATALOG_NAME)
    db.execute("UPDATE entries SET atime_ns = ? WHERE name = ?", (future, paths[0].name))
    db.commit()
    db.close()
    run_gc(tree, max_size=newest.stat().st_size, min_age_s=0)
    assert newest.exists() and not paths[0].exists()  # least recent first, whatever the row said


# -- the quarantine and the modes ----------------------------------------------------------------
def test_gc_never_deletes_what_lies_in_the_quarantine(tmp_path):
    tree, paths = tree_with_blocks(tmp_path / "tree", 2)
    moved = tree.quarantine(paths[0], "run")
    os.utime(moved, ns=(1, 1))  # the oldest file anywhere
    for command in (["gc", tree.root, "--max-size", "0", "--min-age", "0"],
                    ["gc", tree.root, "--max-size", "0", "--min-age", "0", "--no-catalog"]):
        assert run(*command).exit_code == 0
    assert moved.exists() and not paths[1].exists()
    assert run("fsck", tree.root, "--repair", "--grace", "0").exit_code in (0, 1)
    assert moved.exists()


def test_the_umask_narrows_the_configured_modes(tmp_path):
    """security.md: pykv passes the modes to open/mkdir and never chmods, so a umask only narrows them."""
    previous = os.umask(0o077)
    try:
        tree, paths = tree_with_blocks(tmp_path / "tree", 1, TreeOptions(file_mode=0o660, dir_mode=0o770))
        assert run("gc", tree.root, "--max-size", "1G").exit_code == 0
    finally:
        os.umask(previous)
    made = [p for p in tree.root.rglob("*")] + [tree.root]
    assert made and all(os.lstat(p).st_mode & 0o077 == 0 for p in made if p != tree.root)
    assert os.lstat(paths[0]).st_mode & 0o777 == 0o600


# -- names of roots and arguments ----------------------------------------------------------------
@pytest.mark.parametrize("command", [["inspect"], ["fsck"], ["gc", "--max-size", "0"]])
def test_a_root_whose_name_is_not_utf8_prints_as_text(tmp_path, command):
    root = tmp_path / b"t\xff\x1b[31m".decode("utf-8", "surrogateescape")
    tree_with_blocks(root, 1)
    result = run(*command, root)
    assert result.exit_code == 0 and "\x1b" not in result.output, result.output


def test_engine_args_nested_deeper_than_the_stack_are_one_line(tmp_path):
    """Found: ``--engine-args`` of JSON nested too deep was a RecursionError traceback."""
    root = tmp_path / "tree"
    KVTree.create(root)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    result = run("warm", prompts, "--model", tmp_path / "no-model", "--root", root, "--engine-args", DEEP["array"])
    assert one_error_line(result, "--engine-args: not JSON: nested too deeply"), result.output


def test_an_engine_arg_nested_deeper_than_the_stack_is_kept_as_text():
    assert parse_pairs("--engine-arg", ["a=" + DEEP["array"]]) == {"a": DEEP["array"]}
