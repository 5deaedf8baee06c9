"""``pykv fsck``: find and repair damage over the device set of its roots (``pykv.maintenance.fsck_devices``,
one report per device, and ``repair`` of each); one root reports as one tree."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from pykv.auth import AuthStatus, load_key_ring
from pykv.commands.output import JsonFlag, RootsArgument, emit, error_line, line, open_roots, plural, size
from pykv.maintenance import FsckReport, fsck_devices, repair
from pykv.maintenance.quarantine import combined
from pykv.units import parse_duration


def fsck_command(
    roots: RootsArgument,
    repair_: Annotated[bool, typer.Option(
        "--repair", help="Delete pykv's stale temps; move damaged blocks and everything pykv did not create "
                         "to .pykv/quarantine/.")] = False,
    grace: Annotated[str, typer.Option(
        "--grace", metavar="DURATION", help="Temp files younger than this belong to a writer at work.")] = "1h",
    key_file: Annotated[Optional[Path], typer.Option(
        "--key-file", metavar="FILE", help="Key file of authenticated blocks (auth_key_file): also verify each "
                                           "block's MAC and count signed, unsigned, foreign-key and bad-mac "
                                           "blocks; bad-mac is a problem.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Check every file of the tree; exit 1 while problems remain.

    Several ROOTs are one device set: each device is checked and reported on its own. Blocks on
    a device other than the one the set's placement picks are counted as unreachable, not as
    problems: they are never moved or deleted (the set given may be only part of the engines').
    With --key-file, unsigned blocks and blocks of a key id the file does not hold are counted,
    not problems: an engine with the key refuses them as misses.
    """
    grace_s = parse_duration(grace, field="--grace")
    keys = load_key_ring(key_file, field="--key-file") if key_file is not None else None
    devices = open_roots(roots)
    reports = fsck_devices(devices, grace_s=grace_s, keys=keys)
    for tree, report in zip(devices, reports):
        if repair_ and report.findings:
            repair(tree, report, keys)
    if len(reports) == 1:
        emit(reports[0].as_dict(), as_json=as_json, render=_render)
    else:
        emit(_set_dict(reports), as_json=as_json, render=_render_set)
    for report in reports:
        if report.failed:  # the report says which; one line says that repair itself failed
            finding, error = report.failed[0]
            where = f"{report.root}: " if len(reports) > 1 else ""
            message = (f"{where}could not repair {len(report.failed)} of {plural(len(report.findings), 'problem')} "
                       f"(first: {finding.path}: {error})")
            typer.echo(error_line(message), err=True)
    if not all(report.clean for report in reports):
        raise typer.Exit(1)


def _set_dict(reports: list[FsckReport]) -> dict[str, Any]:
    """Several devices: each device's report and the totals."""
    counts: dict[str, int] = {}
    for report in reports:
        for problem, count in report.counts.items():
            counts[problem] = counts.get(problem, 0) + count
    codecs = sum((report.codecs for report in reports), Counter())
    return {"roots": [report.root for report in reports],
            "blocks_checked": sum(r.blocks_checked for r in reports),
            "bytes_checked": sum(r.bytes_checked for r in reports), "counts": counts,
            "unreachable_blocks": sum(r.unreachable_blocks for r in reports),
            "unreachable_bytes": sum(r.unreachable_bytes for r in reports),
            **({} if reports[0].auth is None else {"auth": {
                status.value: sum(r.auth[status.value] for r in reports) for status in AuthStatus}}),
            **({"codecs": dict(codecs)} if codecs else {}),
            "clean": all(r.clean for r in reports), "quarantined": _total_quarantined(reports),
            "devices": [r.as_dict() for r in reports]}


def _total_quarantined(reports: list[FsckReport]) -> dict[str, Any]:
    return combined(report.quarantined for report in reports).as_dict()


def _render_set(out: Console, data: dict[str, Any]) -> None:
    for index, device in enumerate(data["devices"]):
        line(out, f"device {index}: {device['root']} (identity {device['id']})")
        _render(out, device)
        if device["unreachable_blocks"]:
            line(out, f"unreachable {plural(device['unreachable_blocks'], 'block')} "
                      f"({size(device['unreachable_bytes'])}): on this device, placed on another by this set "
                      f"(left in place)")
    _render_codecs(out, data)
    _render_auth(out, data)
    line(out, f"{len(data['devices'])} devices: checked {plural(data['blocks_checked'], 'block')}, "
              f"{plural(data['unreachable_blocks'], 'block')} unreachable; "
              + ("clean" if data["clean"] else "problems remain"))


def _render(out: Console, data: dict[str, Any]) -> None:
    for f in data["findings"]:  # one line each, never wrapped: the path stays copyable
        line(out, f"{f['problem']:<13} {f['path']}  ({f['detail']})")
    if data["findings"]:
        line(out, "found: " + ", ".join(f"{count} {problem}" for problem, count in sorted(data["counts"].items())))
    line(out, f"checked {plural(data['blocks_checked'], 'block')}")
    _render_codecs(out, data)
    _render_auth(out, data)
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
    _render_quarantined(out, data["quarantined"], f"{data['root']}/.pykv/quarantine")
    line(out, "clean" if data["clean"] else "problems remain")


def _render_quarantined(out: Console, quarantined: dict[str, Any], where: str) -> None:
    """One line on what the quarantine holds, if anything (it stays until someone deletes it)."""
    if not quarantined["files"] and not quarantined["unreadable"]:
        return
    text = f"quarantine: {plural(quarantined['files'], 'file')} ({size(quarantined['bytes'])}) in {where}"
    if quarantined["unreadable"]:
        text += f", {quarantined['unreadable']} unreadable"
    if not quarantined["complete"]:
        text += ", counted in part"
    line(out, text + "; kept until deleted by hand")


def _render_codecs(out: Console, data: dict[str, Any]) -> None:
    codecs = data.get("codecs")
    if codecs:  # params come from the files: visible ASCII only (``pykv.format_codec``)
        line(out, "coded: " + ", ".join(f"{plural(count, 'block')} {params}" for params, count in sorted(codecs.items())))


def _render_auth(out: Console, data: dict[str, Any]) -> None:
    auth = data.get("auth")
    if auth is not None:
        line(out, "authenticated: " + ", ".join(f"{auth[status.value]} {status.value}" for status in AuthStatus))
