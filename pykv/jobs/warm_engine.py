"""Inside ``pykv warm``'s engine process: ``python -m pykv.jobs.warm_engine PLAN EVENTS``.

Starts one vLLM engine with pykv in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so it can ask pykv's manager what is on disk) and warms the plan's prompts
(``warm``; ``pykv.jobs.warm`` describes what it does). vLLM only through
``pykv.connector.compat``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from pykv.auth import load_key_ring
from pykv.blockfile import signed_with
from pykv.errors import InputError
from pykv.jobs.progress import EventLog, engine_main
from pykv.jobs.warm import WarmPlan, WarmPrompt, WarmSummary

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]


def engine_manager(llm: Any) -> Any:
    """pykv's scheduler-side manager inside an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from pykv.connector import compat
    from pykv.connector.manager import PykvManager
    manager = compat.scheduler_offloading_manager(llm)
    if not isinstance(manager, PykvManager):
        raise RuntimeError("the engine has no pykv manager in this process; run it with "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 and pykv's kv_transfer_config")
    return manager


def warm(llm: Any, prompts: Sequence[WarmPrompt], *, dry_run: bool = False, batch: int = 16,
         settle_timeout: float = 300.0, progress: Progress | None = None, devices: Any = None) -> WarmSummary:
    """Store the KV of ``prompts`` through ``llm`` (an in-process engine with pykv); see ``pykv.jobs.warm``.

    ``devices``: the ``DeviceSet`` to check for present blocks (default: the engine's own; a dry
    run passes the real set, read only, or None when it does not exist)."""
    from pykv.connector import compat
    from pykv.connector.offload_keys import PromptOffloadKeys
    started = time.monotonic()
    report = progress or (lambda phase, done, total: None)
    manager = engine_manager(llm)
    keys_of = PromptOffloadKeys(manager.config, compat.engine_vllm_config(llm))
    tokenizer = None
    gate = getattr(manager, "gate", None)
    threshold = gate.threshold("disk") if gate is not None else 0
    summary = WarmSummary(prompts=len(prompts), tokens_per_chunk=keys_of.tokens_per_chunk, dry_run=dry_run,
                          breakeven_tokens=None if gate is None else float(threshold))
    if devices is None and not dry_run:
        devices = manager.devices
    ring = load_key_ring(manager.pykv.auth_key_file) if manager.pykv.auth_key_file else None

    def on_disk(key: bytes) -> bool:
        return devices is not None and devices.holder(manager.namespace.id, key) is not None

    def present(key: bytes) -> bool:
        """On disk (with a key file: signed with one of its key ids; other blocks are replaced)."""
        tree = None if devices is None else devices.holder(manager.namespace.id, key)
        return tree is not None and (ring is None or signed_with(tree.block_path(manager.namespace.id, key), ring))
    seen: set[bytes] = set()
    to_store: set[bytes] = set()
    runs: list[dict[str, Any]] = []
    for done, p in enumerate(prompts, start=1):
        if p.token_ids is not None:
            ids = list(p.token_ids)
        else:
            if tokenizer is None:
                try:
                    tokenizer = llm.get_tokenizer()
                except ValueError:  # skip_tokenizer_init (0.32 raises, older versions return None)
                    tokenizer = None
                if tokenizer is None:
                    raise InputError(f"line {p.line}: a text prompt needs the model's tokenizer, and this "
                                     "engine has none (skip_tokenizer_init); give prompt_token_ids instead")
            ids = tokenizer.encode(p.prompt)  # as vLLM tokenizes a text prompt
        keys = keys_of(ids)
        new_keys = [k for k in dict.fromkeys(keys) if k not in seen]
        seen.update(new_keys)
        missing = [k for k in new_keys if not present(k)]
        summary.chunks += len(new_keys)
        full_tokens = len(ids) // keys_of.tokens_per_chunk * keys_of.tokens_per_chunk
        if not keys:
            summary.prompts_too_short += 1
        elif full_tokens < threshold:
            summary.prompts_below_breakeven += 1
            summary.chunks_below_breakeven += len(missing)
            summary.chunks_present += len(new_keys) - len(missing)
        elif all(present(k) for k in keys):  # nothing new to store
            summary.prompts_present += 1
            summary.chunks_present += len(new_keys)
        else:
            summary.chunks_present += len(new_keys) - len(missing)
            to_store.update(missing)
            runs.append({"prompt_token_ids": ids})
        report("plan", done, len(prompts))
    summary.prompts_run = len(runs)
    summary.chunks_stored = len(to_store)
    unsigned = [k for k in to_store if on_disk(k)]  # only with a key file: there but not signed with it
    summary.chunks_unsigned = len(unsigned)
    if not dry_run:  # a load would refuse and quarantine them and vLLM not store them again in that request
        _quarantine(manager, unsigned)
    if dry_run or not runs:
        summary.seconds = round(time.monotonic() - started, 3)
        return summary
    params = compat.SamplingParams(max_tokens=1, temperature=0)
    for first in range(0, len(runs), batch):
        llm.generate(runs[first:first + batch], params, use_tqdm=False)
        report("prefill", min(first + batch, len(runs)), len(runs))
    _settle(llm, lambda: sum(1 for k in to_store if not present(k)), settle_timeout,
            lambda left: report("store", len(to_store) - left, len(to_store)))
    summary.chunks_missing = sum(1 for k in to_store if not present(k))
    summary.chunks_stored -= summary.chunks_missing
    summary.seconds = round(time.monotonic() - started, 3)
    return summary


def _quarantine(manager: Any, keys: Sequence[bytes]) -> None:
    """Move these blocks out of the way as an engine with the key file would on their first hit."""
    run = f"warm-{socket.gethostname()}-{os.getpid()}"
    for key in keys:
        tree = manager.devices.holder(manager.namespace.id, key)
        if tree is None:
            continue
        path = tree.block_path(manager.namespace.id, key)
        try:
            tree.quarantine(path, run)
        except FileNotFoundError:
            continue
        except OSError as exc:  # left in place: its load fails and it shows as not stored
            log.warning("pykv warm: %s: not signed with the key file, and quarantine failed (%s)", path,
                        exc.strerror or exc)


def _settle(llm: Any, missing: Callable[[], int], timeout: float, report: Callable[[int], None]) -> None:
    """Step the in-process engine until the stores are published (vLLM issues a finished
    request's stores in later steps) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    left = missing()
    from pykv.connector import compat
    while left and time.monotonic() < deadline:
        compat.step_engine(llm)
        now = missing()
        if now != left:
            report(now)
        left = now
        if left:
            time.sleep(0.01)
    report(left)




def warm_job(data: dict[str, Any], events: EventLog) -> dict[str, Any]:
    """Start the engine the plan describes and warm its prompts (``data``: the ``WarmPlan`` and
    ``scratch_root``, where a dry run's engine stores)."""
    from pykv.config import PykvConfig, root_keys
    from pykv.connector import compat
    from pykv.deviceset import DeviceSet
    from pykv.jobs.serve import engine_kwargs, with_platform_defaults
    from pykv.tree import MARKER_NAME

    plan = WarmPlan.from_json(data["plan"])
    events.progress("engine", 0, 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the manager must live in this process
    roots, devices = plan.root_paths, None
    where = root_keys(roots)
    if plan.dry_run:  # the engine's pykv writes a scratch tree; the real set is only read
        where = {"root": data["scratch_root"]}
        if all((Path(root) / MARKER_NAME).exists() for root in roots):
            devices = DeviceSet.open(roots)
    config = PykvConfig.from_extra_config({**where, **plan.settings})
    kwargs = {**engine_kwargs(plan.model, with_platform_defaults(plan.vllm_args)), **plan.engine_args}
    if all(p.token_ids is not None for p in plan.prompts):
        kwargs.setdefault("skip_tokenizer_init", True)  # token ids only: no tokenizer needed
    llm = compat.LLM(model=plan.model, **kwargs, kv_transfer_config=config.to_kv_transfer_config(plan.block_tokens))
    summary = warm(llm, plan.prompts, dry_run=plan.dry_run, batch=plan.batch, progress=events.progress, devices=devices)
    return summary.to_json()


if __name__ == "__main__":
    engine_main(warm_job)
