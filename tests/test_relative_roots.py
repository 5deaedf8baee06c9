"""A root written relative to the current directory (``.``, ``./``) is the same tree as its
absolute path to every command; an empty ``ROOT`` (an unset variable) is refused in one line
before anything is read, since it would be the current directory."""

from __future__ import annotations

import os

import pytest
from treefactory import add_block, key, make_tree
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.tree import MARKER_NAME, KVTree


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def in_tree(tmp_path, monkeypatch):
    tree = make_tree(tmp_path)
    for i in range(3):
        add_block(tree, bytes([i * 50]) + key(i))
    monkeypatch.chdir(tree.root)
    return tree


def blocks(tree: KVTree) -> list[str]:
    return sorted(str(p.relative_to(tree.root)) for p in tree.root.rglob("*.kv") if ".pykv" not in p.parts)


@pytest.mark.parametrize("spelling", [".", "./", "./."])
def test_fsck_of_the_current_directory_is_clean(in_tree, spelling):
    result = run("fsck", spelling)
    assert result.exit_code == 0 and "misplaced" not in result.stdout, result.output


def test_fsck_repair_of_dot_moves_what_does_not_belong_into_the_quarantine(in_tree):
    (in_tree.root / "foreignfile").write_bytes(b"not pykv's")
    result = run("fsck", "--repair", ".")
    assert "outside the tree's root" not in result.output, result.output
    assert not (in_tree.root / "foreignfile").exists()
    assert [p.name for p in (in_tree.root / ".pykv" / "quarantine").rglob("foreignfile")] == ["foreignfile"]
    assert len(blocks(in_tree)) == 3  # the sound blocks stay
    assert run("fsck", ".").exit_code == 0


def test_init_of_dot_makes_the_current_directory_a_tree_and_leaves_no_temp(tmp_path, monkeypatch):
    (tmp_path / "kv").mkdir()
    monkeypatch.chdir(tmp_path / "kv")
    result = run("init", ".")
    assert result.exit_code == 0 and result.stdout == f"{tmp_path / 'kv'}: a pykv tree ({MARKER_NAME})\n", result.output
    assert sorted(os.listdir(tmp_path / "kv")) == [MARKER_NAME]


@pytest.mark.parametrize("args", [["gc", "", "--max-size", "0", "--min-age", "0s"],
                                  ["gc", "--max-size", "0", "--min-age", "0s", "--", ""],
                                  ["fsck", ""], ["fsck", "--repair", ""],
                                  ["inspect", ""], ["init", ""], ["doctor", ""]])
def test_an_empty_root_is_refused_and_nothing_changes(in_tree, args):
    before = blocks(in_tree)
    result = run(*args)
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr == "pykv: error: ROOT: an empty path; give the tree's directory\n"
    assert blocks(in_tree) == before and not (in_tree.root / ".pykv" / "catalog.db").exists()


def test_an_option_value_that_is_empty_is_not_taken_for_a_root(in_tree):
    """Only positional arguments are ROOTs: an option's empty value gets that option's own error."""
    result = run("gc", ".", "--max-size", "")
    assert result.exit_code == 2 and "ROOT" not in result.stderr and "max-size" in result.stderr, result.output


def test_a_directory_named_by_spaces_is_a_root_like_any_other(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run("init", " ")
    assert result.exit_code == 0 and (tmp_path / " " / MARKER_NAME).is_file(), result.output
    assert run("fsck", " ").exit_code == 0
