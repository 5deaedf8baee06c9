"""``pykv fsck``: find and repair damage (``pykv.maintenance.fsck`` and ``repair``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from pykv.commands.output import JsonFlag, RootArgument, emit, error_line, table
from pykv.maintenance import fsck, repair
from pykv.tree import KVTree
from pykv.units import parse_duration


def fsck_command(
    root: RootArgument,
    repair_: Annotated[bool, typer.Option(
        "--repair", help="Remove stale temps and foreign files; move damaged blocks to .pykv/quarantine/.")] = False,
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
        typer.echo(error_line(f"could not repair {len(report.failed)} of {len(report.findings)} problems "
                              f"(first: {finding.path}: {error})"), err=True)
    if not report.clean:
        raise typer.Exit(1)


def _render(out: Console, data: dict[str, Any]) -> None:
    if data["findings"]:
        out.print(table(None, ["path", "problem", "detail"],
                        [[f["path"], f["problem"], f["detail"]] for f in data["findings"]]))
        out.print("found: " + ", ".join(f"{count} {problem}" for problem, count in sorted(data["counts"].items())))
    out.print(f"checked {data['blocks_checked']} blocks")
    if data["quarantine"] is not None:
        out.print(f"repaired {data['repaired']} (damaged blocks moved to {data['quarantine']})")
        for failure in data["failed"]:
            out.print(f"could not repair {failure['path']}: {failure['error']}")
    out.print("clean" if data["clean"] else "problems remain")
