"""Processes and mounts for the reliability tests and the soak: forked workers, small tmpfs mounts."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest


def spawn(work: Callable[..., dict], *args: Any) -> tuple[int, int]:
    """Fork a child running ``work(*args)``; its dict comes back as JSON through a pipe (``collect``).

    An exception in the child comes back as ``{"errors": [traceback], "error_count": 1}``.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = work(*args)
        except BaseException:  # noqa: BLE001 - reported to the parent
            result = {"errors": [traceback.format_exc()], "error_count": 1}
        try:
            os.write(write, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def collect(child: tuple[int, int]) -> dict:
    """Wait for a ``spawn``ed child and return its dict (an error entry if it reported nothing)."""
    pid, read = child
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"errors": [f"process {pid} died (wait status {status})"], "error_count": 1}
    return json.loads(data)


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``mount`` (created); skip the test where that needs root."""
    mount.mkdir(exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]
                                           ).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])
