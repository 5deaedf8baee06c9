"""``pykv init``: the one command that creates a root (``pykv/commands/init.py``)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.tree import MARKER_NAME


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def refusal(result) -> str:
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith("pykv: error: ROOT: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_init_creates_a_missing_root_that_the_engine_commands_then_take(tmp_path):
    root = tmp_path / "kv"
    assert "does not exist" in run("config", "--root", root).stderr  # before: refused
    result = run("init", root)
    assert result.exit_code == 0 and result.stdout == f"{root}: a pykv tree ({MARKER_NAME})\n", result.output
    assert (root / MARKER_NAME).is_file()
    config = run("config", "--root", root)
    assert json.loads(config.stdout)["kv_connector_extra_config"]["root"] == str(root)


def test_init_never_creates_parents(tmp_path):
    message = refusal(run("init", tmp_path / "not-mounted" / "kv"))
    assert "never its parents" in message and str(tmp_path / "not-mounted") in message
    assert list(tmp_path.iterdir()) == []


def test_init_refuses_a_file_or_a_path_under_one(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in refusal(run("init", tmp_path / "file"))
    assert "parent of" in refusal(run("init", tmp_path / "file" / "kv"))
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and (tmp_path / "file").read_text() == "x"


def test_init_of_a_relative_root_makes_it_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run("init", "kv").exit_code == 0
    assert (tmp_path / "kv" / MARKER_NAME).is_file()
