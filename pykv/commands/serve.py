"""``pykv serve``: vLLM's OpenAI-compatible server with pykv attached (``pykv.jobs.serve``)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer

from pykv.commands.output import engine_roots, parse_settings, warn
from pykv.config import PykvConfig, root_keys
from pykv.jobs.serve import (DEFAULT_SEED, SEED_ENV, check_vllm_args, engine_env, server_command,
                                  with_platform_defaults)
from pykv.errors import InputError
from pykv.jobs.runner import require_vllm

#: click settings that let vLLM's own flags through untouched (``ctx.args``).
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def serve_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(metavar="MODEL", show_default=False,
                                         help="Model directory or hub id, as vLLM takes it. Every argument after "
                                              "it that pykv does not know goes to vLLM (e.g. --port 8000 "
                                              "--block-size 32).")],
    roots: Annotated[Optional[list[Path]], typer.Option(
        "--root", "--roots", metavar="DIR", show_default=False,
        help="Directory of the pykv tree (default $PYKV_ROOT); it must exist (`pykv init DIR` makes one). "
             "A device set, one directory per device: --root A --root B, or --roots A B (up to the next "
             "option).")] = None,
    dram: Annotated[Optional[str], typer.Option("--dram", metavar="SIZE",
                                                help="DRAM tier size per worker, e.g. 16G (binary units; a bare "
                                                     "number is bytes; default: none).")] = None,
    block_tokens: Annotated[int, typer.Option("--block-tokens", metavar="N",
                                              help="Tokens per storage block (one file); a multiple of vLLM's "
                                                   "--block-size.")] = 256,
    settings: Annotated[Optional[list[str]], typer.Option(
        "--set", metavar="KEY=VALUE", help="Any other pykv key of docs/configuration.md; repeatable.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the vLLM command and environment it would "
                                                            "run; start nothing.")] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with pykv attached (CPU and GPU installs alike).

    Sets PYTHONHASHSEED to 0 unless it is set (every engine of a tree must use the same). On a
    CPU-only install, vLLM reserves --gpu-memory-utilization of the RAM: 0.3 unless given.
    """
    if not roots:
        if not os.environ.get("PYKV_ROOT"):
            raise InputError("--root: missing (or set PYKV_ROOT)")
        roots = [Path(os.environ["PYKV_ROOT"])]
    extra = {**root_keys(engine_roots(roots)), **parse_settings(settings or [])}
    if dram is not None:
        extra["dram_bytes"] = dram
    if block_tokens < 1:
        raise InputError(f"--block-tokens: expected a positive integer, got {block_tokens}")
    config = PykvConfig.from_extra_config(extra).to_kv_transfer_config(block_tokens)
    check_vllm_args(ctx.args)
    require_vllm("pykv serve")
    argv = server_command(model, config, with_platform_defaults(ctx.args))
    env, defaulted = engine_env()
    if dry_run:
        typer.echo(f"{SEED_ENV}={env[SEED_ENV]} " + shlex.join(argv))
        return
    if defaulted:
        warn(f"{SEED_ENV} is unset; using {DEFAULT_SEED} (vLLM's block hashes depend on it: every engine "
             f"and `pykv warm` of a tree must use the same)")
    os.execve(argv[0], argv, env)  # the server replaces this process: signals and exit status are vLLM's

