"""``pykv config``: print a ready ``--kv-transfer-config`` JSON for vLLM (``PykvConfig``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from pykv.commands.output import engine_roots, parse_settings
from pykv.config import DRAM_POLICIES, VERIFY_MODES, PykvConfig, root_keys
from pykv.errors import InputError


def config_command(
    roots: Annotated[list[Path], typer.Option("--root", "--roots", metavar="DIR", show_default=False,
                                              help="Directory of the pykv tree; it must exist (`pykv init DIR` "
                                                   "makes one), a relative one is printed absolute. A device "
                                                   "set, one directory per device (printed as roots): --root A "
                                                   "--root B, or --roots A B (up to the next option).")],
    dram: Annotated[Optional[str], typer.Option("--dram", metavar="SIZE",
                                                help="DRAM tier size per worker, e.g. 16G (binary units; a bare "
                                                     "number is bytes; default: none).")] = None,
    dram_policy: Annotated[Optional[str], typer.Option("--dram-policy", metavar="|".join(DRAM_POLICIES),
                                                       help="DRAM tier replacement policy.")] = None,
    staging: Annotated[Optional[str], typer.Option("--staging", metavar="SIZE",
                                                   help="Transient staging memory per worker, e.g. 2G "
                                                        "(default: auto).")] = None,
    io_depth: Annotated[Optional[int], typer.Option("--io-depth", help="Disk reads and writes in flight.")] = None,
    verify: Annotated[Optional[str], typer.Option("--verify", metavar="|".join(VERIFY_MODES),
                                                  help="Checks on load.")] = None,
    fsync: Annotated[Optional[bool], typer.Option("--fsync/--no-fsync", help="fsync blocks before publishing.",
                                                  show_default=False)] = None,
    block_tokens: Annotated[int, typer.Option("--block-tokens", metavar="N",
                                              help="Tokens per storage block (one file); a multiple of vLLM's "
                                                   "--block-size.")] = 256,
    settings: Annotated[Optional[list[str]], typer.Option(
        "--set", metavar="KEY=VALUE", help="Any other key of docs/configuration.md; repeatable.")] = None,
) -> None:
    """Print the JSON for vLLM's --kv-transfer-config that loads pykv (every key validated, every root
    checked as the engine will check it)."""
    extra: dict[str, object] = root_keys(engine_roots(roots))
    named = {"dram_bytes": dram, "dram_policy": dram_policy, "staging_bytes": staging, "io_depth": io_depth,
             "verify": verify, "fsync": fsync}
    extra.update({key: value for key, value in named.items() if value is not None})
    extra.update(parse_settings(settings or []))
    if block_tokens < 1:
        raise InputError(f"--block-tokens: expected a positive integer, got {block_tokens}")
    config = PykvConfig.from_extra_config(extra)
    typer.echo(json.dumps(config.to_kv_transfer_config(block_tokens), separators=(",", ":")))
