"""``pykv warm``: compute and store the KV of a prompt set so later requests hit (``pykv.jobs.warm``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pykv.commands.output import (EngineArgOption, EngineArgsOption, JsonFlag, emit, engine_roots,
    parse_engine_args, parse_settings, table, warn)
from pykv.auth import load_key_ring
from pykv.config import PykvConfig, root_keys
from pykv.jobs.serve import check_vllm_args
from pykv.jobs.warm import WarmPlan, read_prompts, run_warm
from pykv.errors import InputError
from pykv.jobs.runner import require_vllm

PHASES = {"engine": "starting vLLM", "plan": "checking the tree", "prefill": "prefilling", "store": "storing"}


def warm_command(
    ctx: typer.Context,
    prompts: Annotated[Path, typer.Argument(
        help='JSON lines: {"prompt": "..."} or {"prompt_token_ids": [...]} per line, '
                                'optional "id".', show_default=False)],
    model: Annotated[str, typer.Option("--model", metavar="MODEL", show_default=False,
                                       help="Model name or directory, as given to vLLM.")],
    roots: Annotated[list[Path], typer.Option("--root", "--roots", metavar="DIR", show_default=False,
                                              help="Directory of the pykv tree, as the server's; it must exist "
                                                   "(`pykv init DIR` makes one). A device set, one directory per "
                                                   "device: --root A --root B, or --roots A B (up to the next "
                                                   "option).")],
    block_tokens: Annotated[int, typer.Option("--block-tokens", metavar="N",
                                              help="Tokens per storage block, as `pykv serve "
                                                   "--block-tokens` (and kv_transfer_config block_size).")] = 256,
    engine_arg: EngineArgOption = None,
    engine_args: EngineArgsOption = None,
    settings: Annotated[Optional[list[str]], typer.Option(
        "--set", metavar="KEY=VALUE", help="pykv key of docs/configuration.md (e.g. breakeven_file=...); "
                                           "repeatable.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be stored; store nothing.")] = False,
    skip_bad: Annotated[bool, typer.Option("--skip-bad", help="Skip malformed lines (and count them) instead "
                                                              "of stopping at the first.")] = False,
    batch: Annotated[int, typer.Option("--batch", metavar="N", help="Prompts prefilled together.")] = 16,
    as_json: JsonFlag = False,
) -> None:
    """Prefill every prompt of a file through vLLM with pykv so that later requests load their KV.

    Arguments pykv does not know go to vLLM, as `pykv serve` passes them (e.g. --block-size 32):
    give both the same vLLM flags so that they use the same namespace. Resumable: prompts whose
    blocks are all stored already are skipped. Uses $PYTHONHASHSEED (0 when unset, as pykv serve).
    With --set auth_key_file=FILE every block is signed with the file's write key, and blocks in the
    tree not signed with one of its keys are quarantined and stored again.
    """
    items, bad = read_prompts(prompts, skip_bad=skip_bad)
    roots = engine_roots(roots)
    for line in bad:
        warn(f"skipped {line}")
    extra = parse_settings(settings or [])
    config = PykvConfig.from_extra_config({**root_keys(roots), **extra})  # every key checked up front
    if not config.store:
        raise InputError("--set store: pykv warm exists to store its prompts; leave store at true")
    if config.auth_key_file:  # the engine signs what it stores with this file's write key
        load_key_ring(config.auth_key_file, field="--set auth_key_file")
        extra["auth_key_file"] = str(Path(config.auth_key_file).absolute())
    llm_args = parse_engine_args(engine_args, engine_arg or [], reserved=("model", "kv_transfer_config"))
    if block_tokens < 1:
        raise InputError(f"--block-tokens: expected a positive integer, got {block_tokens}")
    if batch < 1:
        raise InputError(f"--batch: expected a positive integer, got {batch}")
    require_vllm("pykv warm")
    vllm_args = check_vllm_args(ctx.args)
    absolute = [str(root) for root in roots]
    plan = WarmPlan(model=model, root=absolute[0], roots=absolute if len(absolute) > 1 else [], prompts=items,
                    settings=extra, engine_args=llm_args,
                    vllm_args=vllm_args, block_tokens=block_tokens, dry_run=dry_run, batch=batch)
    screen = Console(stderr=True)
    if screen.is_terminal:
        bar, update = _progress_bar(screen)
        with bar:
            summary = run_warm(plan, progress=update)
    else:  # a log or a test: no bar, no stray lines
        summary = run_warm(plan)
    summary["bad_lines"], summary["bad"] = len(bad), bad
    emit(summary, as_json=as_json, render=_render)
    if summary.get("chunks_missing"):
        raise typer.Exit(1)


def _progress_bar(screen: Console):
    """A rich progress bar on stderr (stdout stays clean for --json): (context manager, callback)."""
    columns = (TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    bar = Progress(*columns, console=screen, transient=True)
    task = bar.add_task(PHASES["engine"], total=None)

    def update(phase: str, done: int, total: int) -> None:
        bar.update(task, description=PHASES.get(phase, phase), total=total if phase != "engine" else None,
                   completed=done)
    return bar, update


def _render(screen: Console, s: dict[str, Any]) -> None:
    verb = "would store" if s["dry_run"] else "stored"
    prompts = [["prompts", s["prompts"]], ["prefilled" if not s["dry_run"] else "to prefill", s["prompts_run"]],
               ["already stored", s["prompts_present"]], ["below break-even", s["prompts_below_breakeven"]],
               ["shorter than a block", s["prompts_too_short"]],
               ["bad lines skipped", s["bad_lines"]]]
    chunks = [[verb, s["chunks_stored"]], ["already present", s["chunks_present"]],
              ["below break-even", s["chunks_below_breakeven"]]]
    if s.get("chunks_unsigned"):
        chunks.append(["of those, replacing unsigned or foreign-key", s["chunks_unsigned"]])
    if s.get("chunks_missing"):
        chunks.append(["not stored (failed)", s["chunks_missing"]])
    title = f"blocks ({s['tokens_per_chunk']} tokens each)"
    if s.get("breakeven_tokens") is not None:
        title += f" (disk break-even {s['breakeven_tokens']:.0f} tokens)"
    screen.print(table("prompts", ["", "count"], prompts, right={"count"}))
    screen.print(table(title, ["", "blocks"], chunks, right={"blocks"}))
    if s.get("chunks_missing"):
        warn(f"{s['chunks_missing']} blocks were not stored (see the engine log for store failures)")
