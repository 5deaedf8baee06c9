"""``pykv calibrate``: measure where loading beats recomputing (``pykv.jobs.calibrate``), write the file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pykv.calibration import TIERS, Calibration, parse_lengths, parse_tiers
from pykv.commands.output import (EngineArgOption, EngineArgsOption, JsonFlag, absolute_roots, emit, parse_engine_args,
    parse_settings, table, warn)
from pykv.errors import InputError
from pykv.jobs.calibrate import model_label, run_calibration, save_labelled_plot
from pykv.jobs.calibrate_plan import CalibrationRun
from pykv.units import parse_size

DEFAULT_LENGTHS = "1k,2k,4k,8k,16k,32k,64k,80k"


def calibrate_command(
    model: Annotated[str, typer.Option("--model", metavar="MODEL", show_default=False,
                                       help="Model directory or name, as vLLM takes it.")],
    roots: Annotated[list[Path], typer.Option("--root", "--roots", metavar="DIR", show_default=False,
                                              help="Directory on the medium to calibrate (a scratch tree is made and "
                                                   "removed inside it). A device set, one existing directory per "
                                                   "device (recorded in the file's medium): --root A --root B, or "
                                                   "--roots A B (up to the next option).")],
    lengths: Annotated[Optional[str], typer.Option(
        "--lengths", metavar="LIST", show_default=False,
        help=f"Prefix lengths in tokens (1k = 1024), multiples of --block-tokens, that fit the model's limit "
             f"(config.json or max_model_len); checked before any engine starts. Default: {DEFAULT_LENGTHS}, "
             f"less those over the limit, plus the longest that fits.")] = None,
    tiers: Annotated[str, typer.Option("--tiers", metavar="LIST",
                                       help=f"Tiers to calibrate: {', '.join(TIERS)}.")] = ",".join(TIERS),
    out: Annotated[Path, typer.Option("--out", metavar="FILE", help="Calibration file to write (atomically).")
                   ] = Path("pykv-calibration.json"),
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="FILE",
                                                 help="PNG of TTFT against length (default: --out with .png).")
                    ] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Write no PNG (matplotlib not needed).")] = False,
    repeat: Annotated[int, typer.Option("--repeat", metavar="N", min=1,
                                        help="Runs per length and path; medians are fitted.")] = 3,
    block_tokens: Annotated[int, typer.Option("--block-tokens", metavar="N", min=1,
                                              help="Tokens per storage block, as served (vLLM block_size key).")
                            ] = 256,
    engine_arg: EngineArgOption = None,
    engine_args: EngineArgsOption = None,
    settings: Annotated[Optional[list[str]], typer.Option(
        "--set", metavar="KEY=VALUE", help="pykv key for the pykv engines (docs/configuration.md); repeatable.")
    ] = None,
    dram_bytes: Annotated[Optional[str], typer.Option(
        "--dram-bytes", metavar="SIZE", help="DRAM tier of the store engine, e.g. 4G (default: 1.25 x the "
                                             "longest prompt's KV, from the model's config.json).")] = None,
    bandwidth_size: Annotated[str, typer.Option("--bandwidth-size", metavar="SIZE",
                                                help="Bytes written and read to measure the medium (binary "
                                                     "units; a bare number is bytes).")] = "1G",
    drop_caches: Annotated[Optional[bool], typer.Option(
        "--drop-caches/--no-drop-caches", show_default=False,
        help="Drop the page cache before the disk and gated engines (default: when root).")] = None,
    check_gate: Annotated[bool, typer.Option(
        "--check-gate/--no-check-gate",
        help="After the disk engine, run every length through an engine gated by the fitted thresholds; check "
             "that it is at most 5 % slower than the better of recompute and disk hit (needs the disk tier).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Measure recompute and cache-hit TTFT per length and tier; write the break-even calibration file."""
    tier_list = parse_tiers(tiers)
    plot_path = None if no_plot else (plot or out.with_suffix(".png"))
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError("--plot: matplotlib is not installed (pip install 'pykv[calibrate]'), "
                             "or pass --no-plot") from None
    roots = absolute_roots(roots)
    run = CalibrationRun(model=model, root=roots[0], roots=roots if len(roots) > 1 else [],
                         lengths=parse_lengths(lengths or DEFAULT_LENGTHS, multiple=block_tokens),
                         default_lengths=lengths is None,
                         tiers=tier_list, repeat=repeat, block_tokens=block_tokens,
                         engine_args=parse_engine_args(engine_args, engine_arg or []),
                         settings=parse_settings(settings or []),
                         dram_bytes=None if dram_bytes is None else parse_size(dram_bytes, field="--dram-bytes"),
                         bandwidth_bytes=parse_size(bandwidth_size, field="--bandwidth-size"),
                         drop_caches=drop_caches, check_gate=check_gate)
    for note in run.notes:
        warn(note)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as bar:
        task = bar.add_task("calibrating", total=None)

        def progress(description: str, done: int, total: int) -> None:
            bar.update(task, description=description, completed=done, total=total)

        calibration = run_calibration(run, progress)
    calibration.save(out)
    if plot_path is not None:
        save_labelled_plot(calibration, plot_path)
    data = calibration.to_json()
    data["files"] = {"calibration": str(out), "plot": None if plot_path is None else str(plot_path)}
    emit(data, as_json=as_json, render=_render)


def _render(out: Console, data: dict[str, Any]) -> None:
    calibration = Calibration.from_json(data)
    recompute = {p["tokens"]: p["seconds"] for p in data["recompute"]["points"]}
    cold = {p["tokens"]: p["seconds"] for p in data.get("cold", {}).get("points", [])}
    hits = {name: {p["tokens"]: p["hit_s"] for p in tier.points} for name, tier in calibration.tiers.items()}
    columns = ["tokens", "recompute", "cold"]
    for name in hits:
        columns += [f"{name} hit", f"{name} x"]
    rows = []
    for tokens in sorted(recompute):
        row: list[Any] = [f"{tokens:,}", f"{recompute[tokens]:.4f}", _seconds(cold.get(tokens))]
        for points in hits.values():
            hit = points.get(tokens)
            row += [_seconds(hit), "-" if not hit else f"{recompute[tokens] / hit:.2f}x"]
        rows.append(row)
    title = (f"TTFT in seconds (medians; x = recompute / hit), {model_label(calibration)} on {calibration.gpu}, "
             f"vLLM {calibration.vllm_version}")
    out.print(table(title, columns, rows, right=set(columns)))
    medium = calibration.medium
    bandwidth = medium.get("read_gb_per_s")
    out.print(f"medium: {medium.get('path')}, O_DIRECT read {'-' if bandwidth is None else f'{bandwidth:.2f}'} GB/s, "
              f"page cache {medium.get('page_cache')}")
    for name, tier in calibration.tiers.items():
        threshold = tier.break_even_tokens
        verdict = ("never (every load refused)" if math.isinf(threshold) else
                   "0 (always load)" if threshold == 0 else f"{int(threshold):,} tokens")
        out.print(f"break-even {name}: {verdict}")
    gate = data.get("gate_check")
    if gate:
        _render_gate(out, gate)
    files = data["files"]
    out.print(f"wrote {files['calibration']}" + (f" and {files['plot']}" if files["plot"] else "")
              + f"; serve with kv_connector_extra_config.breakeven_file={files['calibration']}")


def _render_gate(out: Console, gate: dict[str, Any]) -> None:
    """The gated engine per length against the better of recompute and disk hit, and the verdict."""
    limit = f"{(gate['tolerance'] - 1) * 100:.0f} %"
    columns = ["tokens", "gated", "best", "gated / best", "vs engines", "loaded", "right path", f"within {limit}",
               "gate's cost"]
    rows = [[f"{p['tokens']:,}", _seconds(p["gated_s"]), _seconds(p["best_s"]), f"{p['ratio']:.2f}",
             _ratio(p.get("ratio_engines")), f"{p['admitted']}/{p['runs']}", _yes_no(p.get("right")),
             _yes_no(p["ok"]), _gate_cost(p)]
            for p in gate["points"]]
    out.print(table("gate check: TTFT in seconds (medians) with the gate on; best = min(recompute, disk hit), "
                    "each measured in the gated engine where it ran that path (prompts no engine stored; its "
                    "loads less the gate's time), else in the recompute or disk engine; vs engines = gated "
                    "against the recompute and disk engines alone; loaded = runs that loaded; right path = the "
                    "path taken is within the tolerance of the better one in the recompute and disk engines; "
                    "gate's cost = its decision time in the gated engine, and its share of the better path",
                    columns, rows, right=set(columns)))
    wrong = [f"{p['tokens']:,}" for p in gate["points"] if p.get("right") is False]
    if wrong:
        out.print(f"gate check: the gate took the slower path at {', '.join(wrong)} tokens; measure lengths "
                  f"around the break-even length, with more --repeat")
    if gate["all_ok"]:
        out.print(f"gate check: gated pykv within {limit} of the better of recompute and disk hit at every length "
                  f"(max {gate['max_ratio']:.2f})")
        return
    slow = [f"{p['tokens']:,}" for p in gate["points"] if not p["ok"]]
    out.print(f"gate check: gated pykv more than {limit} slower than the better of recompute and disk hit at "
              f"{len(slow)} of {len(gate['points'])} lengths ({', '.join(slow)} tokens; max {gate['max_ratio']:.2f})")


def _gate_cost(point: dict[str, Any]) -> str:
    if "gate_s" not in point:
        return "-"  # a file from before the field, or the counters were not read
    return f"{point['gate_s'] * 1e6:.0f} us ({point['gate_share']:.2%})"


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"  # "-": a file from before the field existed


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"  # "-": a file from before the field existed


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"

