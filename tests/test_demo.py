"""The README's main job: ``pykv demo`` runs real vLLM twice and the second run loads from the tree."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.commands.app import app  # noqa: E402


def test_demo_second_run_is_served_from_the_tree(tmp_path):
    root = tmp_path / "tree"
    root.mkdir()  # a --root must exist (`pykv init`); without one the demo makes a temporary tree itself
    result = CliRunner().invoke(app, ["demo", "--root", str(root)])
    assert result.exit_code == 0, result.output
    assert "loaded from disk: 3" in result.stdout and "outputs equal: True" in result.stdout
    summary = json.loads(CliRunner().invoke(app, ["inspect", str(root), "--json"]).stdout)
    assert summary["files"] == 3
