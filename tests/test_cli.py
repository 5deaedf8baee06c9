from __future__ import annotations

import json
import os

import pytest
from treefactory import BLOCK_SIZE, HOUR, NS, add_block, key, make_tree, set_mtime
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.maintenance.scan import Kind, Scan


def run(*args, env=None):
    return CliRunner(env=env).invoke(app, [str(a) for a in args])


def block_count(tree):
    return len(Scan.of(tree).of_kind(Kind.BLOCK))


@pytest.fixture
def tree(tmp_path):
    tree = make_tree(tmp_path)
    for i in range(4):
        add_block(tree, key(i), accessed_ago=(5 - i) * HOUR, published_ago=6 * HOUR)
    return tree


def test_inspect_tables_and_json(tree):
    result = run("inspect", tree.root)
    assert result.exit_code == 0, result.output
    assert NS.id[:12] in result.stdout and "last gc: never" in result.stdout
    data = json.loads(run("inspect", tree.root, "--json").stdout)
    assert data["files"] == 4 and data["bytes"] == 4 * BLOCK_SIZE and data["last_gc"] is None


def test_inspect_root_from_environment(tree):
    result = run("inspect", "--json", env={"PYKV_ROOT": str(tree.root)})
    assert result.exit_code == 0 and json.loads(result.stdout)["files"] == 4


def test_inspect_without_root(monkeypatch):
    monkeypatch.delenv("PYKV_ROOT", raising=False)
    result = run("inspect")
    assert result.exit_code == 2 and result.stderr == "pykv: error: no ROOT given and PYKV_ROOT is not set\n"


def test_gc_frees_oldest_and_reports(tree):
    oldest = tree.block_path(NS.id, key(0))
    result = run("gc", tree.root, "--max-size", f"{3 * BLOCK_SIZE}", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["freed_files"] == 1 and data["target_reached"] and not oldest.exists()
    table = run("inspect", tree.root)
    assert "last gc:" in table.stdout and "freed 1 file (" in table.stdout


def test_gc_dry_run_deletes_nothing(tree):
    result = run("gc", tree.root, "--max-size", "0", "--dry-run")
    assert result.exit_code == 0 and "would free 4 files" in result.stdout
    assert block_count(tree) == 4


def test_gc_warns_when_min_age_keeps_it_over_size(tree):
    result = run("gc", tree.root, "--max-size", "0", "--min-age", "7h")
    assert result.exit_code == 0 and block_count(tree) == 4
    assert result.stderr.startswith("pykv: warning: could not reach --max-size")


def test_fsck_exit_status_and_repair(tree, tmp_path):
    path = tree.block_path(NS.id, key(1))
    os.truncate(path, 100)
    temp = tree.temp_path(path)
    temp.write_bytes(b"x")
    set_mtime(temp, 2 * HOUR)
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    (tree.root / NS.id / "link").symlink_to(outside)
    result = run("fsck", tree.root, "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["counts"] == {"truncated": 1, "stale-temp": 1, "foreign": 1}
    assert "problems remain" in run("fsck", tree.root).stdout
    repaired = run("fsck", tree.root, "--repair")
    assert repaired.exit_code == 0, repaired.output
    assert outside.read_text() == "precious" and not path.exists() and not temp.exists()
    assert run("fsck", tree.root).exit_code == 0


@pytest.mark.parametrize("args, message", [
    (["gc", "{missing}", "--max-size", "1G"], "no such directory"),
    (["gc", "{plain}", "--max-size", "1G"], "not a pykv tree"),
    (["fsck", "{plain}", "--repair"], "not a pykv tree"),
    (["fsck", "{missing}"], "no such directory"),
    (["inspect", "{plain}"], "not a pykv tree"),
    (["gc", "{tree}", "--max-size", "12Q"], "--max-size: cannot parse size '12Q'"),
    (["gc", "{tree}", "--max-size", "1G", "--min-age", "soon"], "--min-age: cannot parse duration 'soon'"),
    (["fsck", "{tree}", "--grace", "1w", "--repair"], "--grace: cannot parse duration '1w'"),
    (["gc", "{tree}"], "Missing option '--max-size'"),
    (["gc", "{tree}", "--max-size", "1G", "--bogus"], "No such option: --bogus"),
])
def test_bad_input_is_one_line_exit_2_and_deletes_nothing(tree, tmp_path, args, message):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data.kv").write_text("not ours")
    stale = tree.temp_path(tree.block_path(NS.id, key(0)))
    stale.write_bytes(b"x")
    set_mtime(stale, 5 * HOUR)
    paths = {"missing": tmp_path / "missing", "plain": plain, "tree": tree.root}
    result = run(*(a.format(**paths) for a in args))
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("pykv: error: ")
    assert message in result.stderr
    assert block_count(tree) == 4 and stale.exists() and (plain / "data.kv").exists()


def test_help_lists_every_command():
    result = run("--help")
    assert result.exit_code == 0
    assert all(name in result.stdout for name in ("inspect", "gc", "fsck"))


def test_tree_errors_are_one_line(tree, monkeypatch):
    import pykv.commands.fsck as fsck_command

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tree.root))

    monkeypatch.setattr(fsck_command, "fsck_devices", refuse)
    result = run("fsck", tree.root)
    assert result.exit_code == 1 and result.stderr.startswith("pykv: error: [Errno 13] Permission denied")
