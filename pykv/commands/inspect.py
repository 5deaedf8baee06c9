"""``pykv inspect``: what a tree holds (``pykv.maintenance.inspect_tree``; several roots: ``inspect_devices``,
the set's namespaces and a per-device table)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from pykv.commands.output import JsonFlag, NoCatalogFlag, emit, line, open_roots, plural, size, table, visible
from pykv.errors import InputError
from pykv.maintenance import inspect_devices
from pykv.maintenance.evict_record import status_line


def inspect_command(
    roots: Annotated[Optional[list[Path]], typer.Argument(
        metavar="ROOT", show_default=False,
        help="The tree's root directory; default $PYKV_ROOT (one directory). Several: the trees of one "
             "device set, one per device.")] = None,
    as_json: JsonFlag = False,
    no_catalog: NoCatalogFlag = False,
) -> None:
    """Show namespaces with file counts, bytes, age histogram, temp files, the quarantine, the last gc and eviction.

    The quarantine (.pykv/quarantine: what fsck --repair and the engines moved aside) is counted
    apart from the namespaces, per device for a set; links in it are never followed.

    Eviction (per device, from .pykv/evict.json, which each engine's eviction round writes): the
    last round's and the last success's age, behind or not, the last error; STUCK when the device
    is behind or no round succeeded for 10 evict_intervals (at least 600 s).

    Several ROOTs are one device set: the namespaces and ages over all of them, and a table of
    each device's blocks, bytes and share, with the blocks it holds that the set's placement puts
    on another device (unreachable for engines with this set; left in place).
    """
    if not roots:
        if not os.environ.get("PYKV_ROOT"):
            raise InputError("no ROOT given and PYKV_ROOT is not set")
        roots = [Path(os.environ["PYKV_ROOT"])]
    devices = open_roots(roots)
    summary = inspect_devices(devices, use_catalog=not no_catalog)
    if len(devices) == 1:
        emit(summary.summary.as_dict(), as_json=as_json, render=_render)
    else:
        emit(summary.as_dict(), as_json=as_json, render=_render)


def _render(out: Console, data: dict[str, Any]) -> None:
    rows = [[ns["id"][:12] or "(root)", ns["description"], ns["files"], size(ns["bytes"]), ns["temp_files"],
             ns["foreign"]] for ns in data["namespaces"]]
    rows.append(["total", "", data["files"], size(data["bytes"]), data["temp_files"], data["foreign"]])
    quarantine = data["quarantine"]  # apart from the total: never served, never gc'd
    rows.append(["quarantine", _quarantine_note(quarantine), quarantine["files"], size(quarantine["bytes"]), "-", "-"])
    title = str(data["root"]) if "root" in data else f"{len(data['roots'])} devices"
    out.print(table(title, ["namespace", "description", "files", "bytes", "temps", "foreign"], rows,
                    right={"files", "bytes", "temps", "foreign"}))
    if "devices" in data:
        _render_devices(out, data)
    out.print(table("age since publication", ["age", "files"],
                    [[label, count] for label, count in data["ages"].items()], right={"files"}))
    if data["temp_files"]:
        out.print(f"{plural(data['temp_files'], 'temp file')} ({size(data['temp_bytes'])}), "
                  f"oldest {data['oldest_temp_age_s']:.0f}s")
    gc = data["last_gc"]
    if gc:
        when = datetime.datetime.fromtimestamp(gc.get("finished_at", 0)).isoformat(timespec="seconds")
        out.print(f"last gc: {when}, freed {plural(gc.get('freed_files', 0), 'file')} ({size(gc.get('freed_bytes', 0))}), "
                  f"target {'reached' if gc.get('target_reached') else 'NOT reached'}")
    else:
        out.print("last gc: never")
    roots = data["roots"] if "roots" in data else [data["root"]]
    for index, (root, eviction) in enumerate(zip(roots, data["eviction"])):
        where = f" device {index} ({root})" if len(roots) > 1 else ""
        line(out, visible(f"eviction{where}: {status_line(eviction)}"))
    out.print(f"scanned in {data['seconds']:.2f}s ({data['dirs_listed']} dirs listed, "
              f"{data['dirs_cached']} from catalog)")


def _quarantine_note(quarantine: dict[str, Any]) -> str:
    """The quarantine row's description: where it is, and what the count could not see."""
    note = ".pykv/quarantine, not served"
    if quarantine["unreadable"]:
        note += f", {quarantine['unreadable']} unreadable"
    return note if quarantine["complete"] else note + ", counted in part"


def _render_devices(out: Console, data: dict[str, Any]) -> None:
    rows = [[d["root"], d["id"], d["blocks"], size(d["bytes"]), f"{d['share']:.1%}", d["unreachable_blocks"]]
            for d in data["devices"]]
    rows.append(["total", "", data["files"], size(data["bytes"]), "100.0%" if data["bytes"] else "-",
                 data["unreachable_blocks"]])
    out.print(table("devices", ["root", "identity", "blocks", "bytes", "share", "unreachable"], rows,
                    right={"blocks", "bytes", "share", "unreachable"}))
    held = [f"device {index}: {plural(d['quarantine']['files'], 'file')} ({size(d['quarantine']['bytes'])})"
            for index, d in enumerate(data["devices"]) if d["quarantine"]["files"] or d["quarantine"]["unreadable"]]
    if held:
        out.print("quarantine by device: " + ", ".join(held))
    if data["unreachable_blocks"]:
        out.print(f"unreachable: {plural(data['unreachable_blocks'], 'block')} ({size(data['unreachable_bytes'])}) "
                  "on a device other than the one this set places them on (stored before a device was added or "
                  "removed, or the set given is incomplete): engines with this set never read them; left in place, "
                  "gc ages them out")
