"""Bind mounts for tests (root only): ``bind(source, target)`` mounts, the fixture unmounts them all."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def bind():
    """``bind(source, target, read_only=False)``: ``target`` (made if missing) becomes a bind mount of
    ``source``; every mount is undone after the test. Skips the test when ``mount`` fails (not root)."""
    mounted: list[Path] = []

    def mount(source: Path, target: Path, read_only: bool = False) -> Path:
        target.mkdir(exist_ok=True)
        steps = [["mount", "--bind", str(source), str(target)]]
        if read_only:
            steps.append(["mount", "-o", "remount,bind,ro", str(target)])
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"{' '.join(step)} failed (needs root): {done.stderr.strip()}")
            if step[1] == "--bind":
                mounted.append(target)
        return target

    try:
        yield mount
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", str(target)], check=False)
