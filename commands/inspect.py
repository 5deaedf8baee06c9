"""``pykv inspect``: what a tree holds (``pykv.maintenance.inspect_tree``)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from pykv.commands.output import JsonFlag, NoCatalogFlag, emit, plural, size, table
from pykv.errors import InputError
from pykv.maintenance import inspect_tree
from pykv.tree import KVTree


def inspect_command(
    root: Annotated[Optional[Path], typer.Argument(
        envvar="PYKV_ROOT", show_default=False,
        help="The tree's root directory; default $PYKV_ROOT.")] = None,
    as_json: JsonFlag = False,
    no_catalog: NoCatalogFlag = False,
) -> None:
    """Show namespaces with file counts, bytes, age histogram, temp files and the last gc."""
    if root is None:
        raise InputError("no ROOT given and PYKV_ROOT is not set")
    summary = inspect_tree(KVTree.open(root), use_catalog=not no_catalog)
    emit(summary.as_dict(), as_json=as_json, render=_render)


def _render(out: Console, data: dict[str, Any]) -> None:
    rows = [[ns["id"][:12] or "(root)", ns["description"], ns["files"], size(ns["bytes"]), ns["temp_files"],
             ns["foreign"]] for ns in data["namespaces"]]
    rows.append(["total", "", data["files"], size(data["bytes"]), data["temp_files"], data["foreign"]])
    out.print(table(str(data["root"]), ["namespace", "description", "files", "bytes", "temps", "foreign"], rows,
                    right={"files", "bytes", "temps", "foreign"}))
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
    out.print(f"scanned in {data['seconds']:.2f}s ({data['dirs_listed']} dirs listed, "
              f"{data['dirs_cached']} from catalog)")
