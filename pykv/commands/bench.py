"""``pykv bench``: O_DIRECT throughput of the io_uring and thread-pool engines (``pykv.bench``)."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pykv.bench import fio_available, run_bench
from pykv.bench_codecs import bench_codecs, describe, medium_read, parse_codecs
from pykv.codec import CODEC_NAMES
from pykv.commands.output import JsonFlag, emit, table, warn
from pykv.config import PykvConfig
from pykv.errors import InputError
from pykv.format import ALIGNMENT
from pykv.io.probe import direct_io_supported
from pykv.units import format_size, parse_int_list, parse_size, require_multiple


def bench_command(
    paths: Annotated[Optional[list[Path]], typer.Option(
        "--path", metavar="DIR", help="Directory on the medium to measure (default: a temp directory); repeat "
                                      "for several devices: measured all at once (device 'all') and each alone.")
    ] = None,
    depth: Annotated[str, typer.Option("--depth", metavar="LIST", help="I/O depths, e.g. 1,4,16,64.")] = "1,4,16,64",
    block_size: Annotated[str, typer.Option(
        "--block-size", metavar="SIZE", help="Request size; a multiple of 4 KiB.")] = "28M",
    size: Annotated[str, typer.Option("--size", metavar="SIZE", help="Bytes written and read per pass.")] = "4G",
    repeat: Annotated[int, typer.Option("--repeat", min=1, help="Passes per engine and depth; the median is shown.")] = 1,
    files: Annotated[bool, typer.Option(
        "--files/--no-files", help="Also measure the reactor storing and loading real block files.")] = True,
    fio: Annotated[bool, typer.Option("--fio/--no-fio", help="Run fio side by side when it is installed.")] = True,
    read_segment: Annotated[str, typer.Option(
        "--read-segment", metavar="SIZE",
        help="Reactor file loads split each block read into pieces of SIZE (the read_segment_bytes key); 0: one read.",
    )] = "0",
    codec: Annotated[Optional[list[str]], typer.Option(
        "--codec", metavar="NAME", help=f"Also measure codec NAME ({', '.join(CODEC_NAMES)}; repeat or a comma list) on "
                                        "a KV-like bf16 block of --block-size: stored/raw ratio, encode and decode "
                                        "GB/s, and the KV GB/s a disk hit could reach.")] = None,
    codec_threads: Annotated[Optional[int], typer.Option(
        "--codec-threads", min=1, help="Threads of the codec measurements (default: the codec_threads key's auto).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Measure O_DIRECT read and write throughput of each I/O engine at each depth (fio beside, if installed).

    Several --path: every engine and fio on all devices at once (--size and --depth per device),
    then on each device alone; the reactor's files over all of them as one device set.

    --codec NAME (repeat or a comma list): each codec also stores and restores one --block-size block
    of KV-like bf16 (planes-zstd on --codec-threads; fp8 through its torch functions on the CPU, and on
    the GPU when CUDA is available). One line per codec: its stored/raw ratio, encode and decode GB/s
    of KV, and the KV GB/s a disk hit could reach, min(R / ratio, decode GB/s), R being the raw read
    pass at the deepest depth (R itself for none); the estimate assumes decoding pipelined with the
    reads, as the engine does. --json has the figures under codecs.
    """
    depths = parse_int_list(depth, field="--depth")
    block = require_multiple(parse_size(block_size, field="--block-size"), ALIGNMENT, field="--block-size")
    total = parse_size(size, field="--size")
    segment = parse_size(read_segment, field="--read-segment")
    if segment:
        require_multiple(segment, ALIGNMENT, field="--read-segment")
    if total < block:
        raise InputError(f"--size: {format_size(total)} is smaller than --block-size {format_size(block)}")
    total -= total % block
    codecs = parse_codecs(codec or [])
    threads = codec_threads or PykvConfig().codec_worker_threads()
    given: list[Path | None] = list(paths) if paths else [None]
    for path in given:
        if path is not None and not path.is_dir():
            raise InputError(f"--path: {path} is not a directory")
    with contextlib.ExitStack() as stack:
        directories = [Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pykv-bench-", dir=path)))
                       for path in given]
        for path, directory in zip(given, directories):
            supported, reason = direct_io_supported(directory)
            if not supported:
                raise InputError(f"--path: {path or directory} does not support O_DIRECT ({reason})")
        if fio and not fio_available():
            warn("fio is not installed; measuring pykv only")
        screen = Console(stderr=True)

        def run(progress: Any = None) -> list[Any]:
            return run_bench(directories[0] if len(directories) == 1 else directories, depths=depths,
                             block_size=block, size=total, repeat=repeat,
                             with_fio=fio, with_files=files, read_segment=segment, progress=progress)
        if screen.is_terminal:  # a bar on stderr for people; logs and pipes get none
            with Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=screen, transient=True) as bar:
                task = bar.add_task("writing the test file", total=None)
                results = run(lambda step, done, total: bar.update(task, description=step, completed=done,
                                                                   total=total))
        else:
            results = run()
    where = {"path": str(given[0] or tempfile.gettempdir())} if len(given) == 1 else {"paths": [str(p) for p in given]}
    named = {str(directory): str(path) for path, directory in zip(given, directories)}  # the temp dir: its --path
    data = {**where, "block_size": block, "size": total, "repeat": repeat,
            "results": [{**r.as_dict(), **({"device": named.get(r.device, r.device)} if r.device else {})}
                        for r in results]}
    if codecs:
        read, source = medium_read(data["results"])
        data["codecs"] = {"block_size": block, "payload": "kv-like bf16", "threads": threads, "read_gb_per_s": read,
                          "read_pass": source, "results": [f.as_dict() for f in bench_codecs(
                              codecs, block_size=block, threads=threads, read_gb_per_s=read)]}
    emit(data, as_json=as_json, render=_render)


def _render(out: Console, data: dict[str, Any]) -> None:
    rows = []
    results = data["results"]
    for r in results:
        fio = next((f for f in results if f["engine"].startswith("fio") and f["op"] == r["op"]
                    and f["depth"] == r["depth"] and f.get("device") == r.get("device")), None)
        ratio = f"{r['gb_per_s'] / fio['gb_per_s']:.0%}" if fio and fio["gb_per_s"] else "-"
        device = [] if "path" in data else [r["device"]]
        rows.append([r["op"], r["depth"], *device, r["engine"], f"{r['gb_per_s']:.3f}", ratio])
    if "path" in data:
        rows.sort(key=lambda row: (row[0], row[1]))
        columns, where = ["op", "depth", "engine", "GB/s", "of fio"], data["path"]
    else:  # the aggregate first, then each device in the order given
        order = {device: i for i, device in enumerate(["all", *data["paths"]])}
        rows.sort(key=lambda row: (row[0], row[1], order.get(row[2], len(order))))
        columns, where = ["op", "depth", "device", "engine", "GB/s", "of fio"], f"{len(data['paths'])} devices"
    out.print(table(f"O_DIRECT throughput, {format_size(data['block_size'])} requests, "
                    f"{format_size(data['size'])} per pass" + ("" if "path" in data else " and device") + f", {where}",
                    columns, rows, right={"depth", "GB/s", "of fio"}))
    if "codecs" in data:
        codecs = data["codecs"]
        source = f", reads: {codecs['read_pass']}" if codecs["read_pass"] else ""
        out.print(f"Codecs on one {format_size(codecs['block_size'])} block of {codecs['payload']}{source}:",
                  soft_wrap=True)
        for figures in codecs["results"]:
            out.print("  " + describe(figures, codecs["read_gb_per_s"]), soft_wrap=True)
