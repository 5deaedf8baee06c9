"""``pykv demo``: the same prompt twice through vLLM with pykv, then ``pykv inspect`` of the tree."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from pykv.commands.inspect import inspect_command
from pykv.commands.output import console, engine_roots, table
from pykv.counters import WorkerCounter
from pykv.jobs.demo import PROMPT_TOKENS, STEPS, STORAGE_BLOCK_TOKENS, run_demo
from pykv.jobs.runner import require_vllm


def demo_command(
    roots: Annotated[Optional[list[Path]], typer.Option(
        "--root", "--roots", metavar="DIR",
        help="Tree to use and keep; it must exist (`pykv init DIR` makes one; default: a temporary tree the "
             "demo makes and removes). A device set, one directory per device: --root A --root B, or --roots "
             "A B.")] = None,
    log: Annotated[Path, typer.Option("--log", metavar="FILE", help="Where the engine's log goes.")] = Path(
        "pykv-demo.log"),
) -> None:
    """Run a tiny random Llama through vLLM with pykv twice; the second run loads its KV from the tree."""
    if roots:
        roots = engine_roots(roots)
    require_vllm("pykv demo")
    log = log.absolute()
    with tempfile.TemporaryDirectory(prefix="pykv-demo-") as directory:  # the model, results, default tree
        work = Path(directory)
        if not roots:
            roots = [work / "tree"]
            roots[0].mkdir()  # the demo's own tree: engines never create a root
        _run_demo(roots, work, log)


def _run_demo(roots: list[Path], work: Path, log: Path) -> None:
    typer.echo(f"starting vLLM with pykv (tree {', '.join(map(str, roots))}, engine log {log}); the engine takes "
               "about a minute to start ...", err=True)
    started = time.monotonic()

    def say(phase: str, done: int, total: int) -> None:
        step = STEPS.get(phase, phase).format(done=done, total=total)
        typer.echo(f"  {time.monotonic() - started:5.0f} s  {step}", err=True)

    runs, counters = run_demo(roots, work, log, progress=say)
    first, second = runs
    worker = counters.worker(0)
    rows = [[r["run"], r["num_cached_tokens"], f"{r['seconds']:.3f}", " ".join(map(str, r["tokens"]))] for r in runs]
    screen = console()
    screen.print(table(f"the same {PROMPT_TOKENS:,}-token prompt twice", ["run", "tokens from pykv", "seconds",
                                                                         "output tokens"],
                    rows, right={"run", "tokens from pykv", "seconds"}))
    full = PROMPT_TOKENS // STORAGE_BLOCK_TOKENS
    screen.print(f"blocks stored: {worker.get(WorkerCounter.STORE_PUBLISHED, 0)}, loaded from disk: "
                 f"{worker.get(WorkerCounter.LOAD_BLOCKS_DISK, 0)}; outputs equal: {first['tokens'] == second['tokens']}")
    screen.print(f"pykv stores whole blocks of {STORAGE_BLOCK_TOKENS} tokens: the prompt's {full} full blocks "
                 f"({full * STORAGE_BLOCK_TOKENS:,} tokens) come from pykv, its last "
                 f"{PROMPT_TOKENS - full * STORAGE_BLOCK_TOKENS} tokens are computed again.")
    screen.print(f"engine log: {log}")
    inspect_command(roots)
