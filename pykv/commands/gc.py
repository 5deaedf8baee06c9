"""``pykv gc``: delete least-recently-accessed blocks until the device set of its roots fits
(``pykv.maintenance.run_gc_devices``: the limit is the set's total; one root is one tree's gc)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from pykv.commands.output import JsonFlag, NoCatalogFlag, RootsArgument, emit, open_roots, plural, size, table, warn
from pykv.maintenance import run_gc_devices
from pykv.units import parse_duration, parse_size


def gc_command(
    roots: RootsArgument,
    max_size: Annotated[str, typer.Option(
        "--max-size", metavar="SIZE", show_default=False,
        help="Size the tree must fit in, e.g. 500G (binary units); with several ROOTs, their total: "
             "blocks of all devices go in one least-recently-accessed order.")],
    min_age: Annotated[str, typer.Option(
        "--min-age", metavar="DURATION", help="Never delete blocks published less than this long ago.")] = "10m",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be deleted; delete nothing.")] = False,
    as_json: JsonFlag = False,
    no_catalog: NoCatalogFlag = False,
) -> None:
    """Delete least-recently-accessed blocks until the tree fits in --max-size.

    Several ROOTs are one device set: --max-size bounds their total, every device keeps its own
    catalog and gc.json. Blocks the set cannot reach (on a device other than the one placement
    picks) are not preferred: no engine reads them, so they age out in LRU order.
    """
    limit = parse_size(max_size, field="--max-size")
    min_age_s = parse_duration(min_age, field="--min-age")
    result = run_gc_devices(open_roots(roots), limit, min_age_s=min_age_s, dry_run=dry_run,
                            use_catalog=not no_catalog)
    emit(result.summary(), as_json=as_json, render=_render)
    if not result.target_reached:
        warn(f"could not reach --max-size {size(limit)}: {size(result.remaining_bytes)} remain, "
             f"{plural(result.young_files, 'block')} ({size(result.young_bytes)}) are younger than --min-age {min_age}")


def _render(out: Console, data: dict[str, Any]) -> None:
    verb = "would free" if data["dry_run"] else "freed"
    if "devices" in data:
        rows = [[d["root"], d["blocks"], size(d["bytes"]), size(d["freed_bytes"]), d["unreachable_blocks"]]
                for d in data["devices"]]
        out.print(table(None, ["device", "blocks", "bytes", verb, "unreachable"], rows,
                        right={"blocks", "bytes", verb, "unreachable"}))
    rows = [[ns[:12], size(freed)] for ns, freed in sorted(data["freed_by_namespace"].items())]
    if rows:
        out.print(table(None, ["namespace", verb], rows, right={verb}))
    out.print(f"{verb} {plural(data['freed_files'], 'file')} ({size(data['freed_bytes'])}); "
              f"tree {size(data['total_bytes'])} -> {size(data['remaining_bytes'])}, "
              f"limit {size(data['max_size'])}; {data['seconds']:.2f}s")
    if data["vanished_files"]:
        out.print(f"{plural(data['vanished_files'], 'file')} ({size(data['vanished_bytes'])}) deleted by someone else "
                  "meanwhile")
    if data["junk_files"]:
        out.print(f"{plural(data['junk_files'], 'file')} ({size(data['junk_bytes'])}) at block names are not blocks "
                  "pykv wrote: left in place, see 'pykv fsck'")
    if data.get("undeleted_files"):
        out.print(f"{plural(data['undeleted_files'], 'block')} ({size(data['undeleted_bytes'])}) could not be deleted "
                  "(a read-only tree, or a link above them): see the warnings")
