"""``pykv doctor``: what a mount does for pykv, one verdict per item (``pykv.maintenance.doctor``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pykv.commands.output import JsonFlag, emit, line
from pykv.maintenance.doctor import diagnose


# Text, not a Path: typer stats a Path argument while parsing it, which a stalled mount never answers;
# diagnose() asks the mount on a thread with a time limit first.
DoctorRoot = Annotated[str, typer.Argument(
    metavar="ROOT", show_default=False, help="The tree's root directory (holding pykv-tree.json).")]


def doctor_command(root: DoctorRoot, as_json: JsonFlag = False) -> None:
    """Probe a tree's mount (or an empty directory): whether it answers, publication by hard link,
    O_DIRECT, io_uring, atime, free space, the tree marker, the hash seed, and the engines' eviction
    as last recorded (warns when STUCK or the record is unreadable). On a stalled mount it answers
    within 10 s. Exit 1 when an item fails."""
    report = diagnose(Path(root))
    emit(report.as_dict(), as_json=as_json, render=_render)
    if report.failed:
        raise typer.Exit(1)


def _render(out: Console, data: dict[str, Any]) -> None:
    for check in data["checks"]:
        line(out, f"{check['verdict']:<5} {check['item']:<14} {check['detail']}")
    counts = data["counts"]
    line(out, f"{data['verdict']}: " + ", ".join(f"{counts[v]} {v}" for v in ("ok", "warn", "fail", "skip")))
