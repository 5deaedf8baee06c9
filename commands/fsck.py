"""``pykv fsck``: find and repair damage (``pykv.maintenance.fsck`` and ``repair``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from pykv.commands.output import JsonFlag, RootArgument, emit, error_line, line, plural
from pykv.maintenance import fsck, repair
from pykv.tree import KVTree
from pykv.units import parse_duration


def fsck_command(
    root: RootArgument,
    repair_: Annotated[bool, typer.Option(
        "--repair", help="Delete pykv's stale temps; move damaged blocks and everything pykv did not create "
                         "to .pykv/quarantine/.")] = False,
    grace: Annotated[str, typer.Option(
        "--grace", metavar="DURATION", help="Temp files younger than this belong to a writer at work.")] = "1h",
    as_json: JsonFlag = False,
) -> None:
    """Check every file of the tree; exit 1 while problems remain."""
    grace_s = parse_duration(grace, field="--grace")
    tree = KVTree.open(root)
    report = fsck(tree, grace_s=grace_s)
    if repair_ and report.findings:
        repair(tree, report)
    emit(report.as_dict(), as_json=as_json, render=_render)
    if report.failed:  # the report says which; one line says that repair itself failed
        finding, error = report.failed[0]
        typer.echo(error_line(f"could not repair {len(report.failed)} of {plural(len(report.findings), 'problem')} "
                              f"(first: {finding.path}: {error})"), err=True)
    if not report.clean:
        raise typer.Exit(1)


def _render(out: Console, data: dict[str, Any]) -> None:
    for f in data["findings"]:  # one line each, never wrapped: the path stays copyable
        line(out, f"{f['problem']:<13} {f['path']}  ({f['detail']})")
    if data["findings"]:
        line(out, "found: " + ", ".join(f"{count} {problem}" for problem, count in sorted(data["counts"].items())))
    line(out, f"checked {plural(data['blocks_checked'], 'block')}")
    if data["quarantine"] is not None:
        deleted, moved = data["deleted"], data["moved"]
        line(out, f"repaired {data['repaired']}: deleted {plural(len(deleted), 'stale temp')} of pykv's, "
                  f"moved {plural(len(moved), 'entry', 'entries')} to {data['quarantine']}")
        for path in moved:
            line(out, f"moved    {path}")
        for path in deleted:
            line(out, f"deleted  {path}")
        for failure in data["failed"]:
            line(out, f"could not repair {failure['path']}: {failure['error']}")
    line(out, "clean" if data["clean"] else "problems remain")
