"""``pykv init``: the one command that creates a root (``pykv/commands/init.py``)."""

from __future__ import annotations

import json
import os

import pytest
from mounts import bind  # noqa: F401  (fixture)
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.deviceset import DeviceSet
from pykv.errors import NestedTreeError
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


# -- issue 36: inside a tree, and every OS failure as one line ------------------------------------
def live_tree(tmp_path):
    """A tree with a namespace, a shard holding a block and a quarantine: the places init must refuse."""
    from treefactory import NS, add_block, key, make_tree
    tree = make_tree(tmp_path)
    block = add_block(tree, key(1))
    (tree.state_dir / "quarantine" / "run1").mkdir(parents=True)
    return tree, {"namespace": tree.namespace_dir(NS.id), "shard": block.parent, "state": tree.state_dir,
                  "quarantine": tree.state_dir / "quarantine", "quarantine run": tree.state_dir / "quarantine" / "run1",
                  "new directory in a namespace": tree.namespace_dir(NS.id) / "new"}


@pytest.mark.parametrize("place", ["namespace", "shard", "state", "quarantine", "quarantine run",
                                   "new directory in a namespace"])
def test_init_refuses_a_directory_inside_a_tree(tmp_path, place):
    tree, places = live_tree(tmp_path)
    target = places[place]
    before = sorted(str(p) for p in tree.root.rglob("*"))
    message = refusal(run("init", target))
    assert f"{target} lies inside the pykv tree {tree.root}" in message
    assert sorted(str(p) for p in tree.root.rglob("*")) == before  # no marker, no directory written
    if target.exists():  # nor does an engine take it
        assert "lies inside the pykv tree" in run("config", "--root", target).stderr
        with pytest.raises(NestedTreeError):
            DeviceSet.create([target])
        assert sorted(str(p) for p in tree.root.rglob("*")) == before


def test_init_refuses_a_tree_inside_a_tree_reached_through_a_bind_mount(tmp_path, bind):
    tree, places = live_tree(tmp_path)
    mount = bind(tree.root, tmp_path / "m")
    message = refusal(run("init", mount / places["namespace"].name))
    assert "lies inside the pykv tree" in message
    assert run("init", mount).exit_code == 0  # the tree itself, again: nothing to do


def test_init_of_a_dangling_link_a_path_below_a_file_or_a_fifo_is_one_line(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    assert "symbolic link to nothing" in refusal(run("init", tmp_path / "dangling"))
    assert "parent of" in refusal(run("init", tmp_path / "file" / "kv"))
    assert "not a directory" in refusal(run("init", tmp_path / "fifo"))
    assert "parent of" in refusal(run("init", tmp_path / "fifo" / "kv"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "fifo", "file"]


def test_init_under_an_unwritable_parent_is_one_line(tmp_path, bind):
    (tmp_path / "disk" / "empty").mkdir(parents=True)
    read_only = bind(tmp_path / "disk", tmp_path / "ro", read_only=True)
    assert "cannot create" in refusal(run("init", read_only / "kv"))
    assert "cannot make" in refusal(run("init", read_only / "empty"))
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["empty"]
