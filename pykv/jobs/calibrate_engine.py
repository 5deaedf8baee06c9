"""Inside a calibration's engine process: ``python -m pykv.jobs.calibrate_engine PLAN EVENTS``.

Starts the phase's engine, then runs its steps: ``measure`` (one request, its TTFT, the
tokens it found cached and the blocks pykv's worker loaded per tier, from its counters; in the
gated engine also the gate's decision microseconds) and ``settle`` (wait until the
store engine's stores are published). Emits ``started``, ``sample`` and ``settled`` events (``pykv.jobs.progress``). vLLM only through
``pykv.connector.compat``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pykv.calibration import TIERS
from pykv.counters import SchedulerCounter, WorkerCounter, read_counters
from pykv.jobs.calibrate_plan import prompt_tokens
from pykv.jobs.progress import EventLog, engine_main
from pykv.jobs.settle import wait_until_quiet

log = logging.getLogger(__name__)
LOADED = {"disk": WorkerCounter.LOAD_BLOCKS_DISK, "dram": WorkerCounter.LOAD_BLOCKS_DRAM}
"""The worker counter of blocks loaded from each tier."""


def describe_engine(root: str | None) -> dict[str, Any]:
    """The engine's vLLM version and device, and (with pykv) the rank-0 namespace it created."""
    from pykv.connector import compat
    from pykv.io.safe_paths import read_small
    from pykv.tree import NAMESPACE_FILE, KVTree

    info: dict[str, Any] = {"vllm_version": compat.VLLM_VERSION, "gpu": compat.device_name()}
    if root:
        for directory in KVTree.open(root).namespaces():
            data = json.loads(read_small(directory / NAMESPACE_FILE))
            if str(data.get("extra", {}).get("rank", "0")) == "0":
                info["namespace"] = data
    return info


def worker_loads(stats: str) -> dict[str, int]:
    """Blocks rank 0 loaded so far, per tier."""
    worker = read_counters(stats).worker(0)
    return {tier: int(worker.get(LOADED[tier], 0)) for tier in TIERS}


def gate_timing(stats: str) -> dict[str, int]:
    """The scheduler's surveys so far and the microseconds the gate took deciding (``SchedulerCounter``)."""
    scheduler = read_counters(stats).scheduler()
    return {"surveys": int(scheduler.get(SchedulerCounter.SURVEYS, 0)),
            "gate_us": int(scheduler.get(SchedulerCounter.GATE_US, 0))}


def gate_delta(stats: str, before: dict[str, int], timeout: float = 2.0) -> dict[str, int]:
    """This request's gate microseconds (``gate_us``), once the scheduler's counter file shows its
    survey (written a moment after it); {} if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        after = gate_timing(stats)
        if after["surveys"] > before.get("surveys", 0):
            return {"gate_us": after["gate_us"] - before.get("gate_us", 0)}
        if time.monotonic() > deadline:
            return {}
        time.sleep(0.02)


def settle(stats: str, timeout: float) -> bool:
    """Wait until the store engine's stores are published and committed (nothing pending, no
    change); False if they were still pending after ``timeout`` seconds."""
    quiet, _ = wait_until_quiet(stats, timeout)
    if not quiet:
        log.warning("pykv calibrate: stores still pending after %.0f s", timeout)
    return quiet


def calibration_phase(plan: dict[str, Any], events: EventLog) -> dict[str, Any]:
    """One phase (``pykv.jobs.calibrate_plan.Phase``, with ``stats`` and ``block_tokens``)."""
    from pykv.connector import compat

    started = time.perf_counter()
    llm = compat.LLM(**plan["engine"])
    extra = (plan["engine"].get("kv_transfer_config") or {}).get("kv_connector_extra_config", {})
    root = extra.get("root") or (extra.get("roots") or [None])[0]  # every device holds the namespace records
    events.emit("started", seconds=round(time.perf_counter() - started, 2), engine=describe_engine(root))
    params = compat.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    stats, block_tokens = plan["stats"], plan["block_tokens"]
    for step in plan["steps"]:
        if step["op"] == "settle":
            began = time.perf_counter()
            complete = settle(stats, timeout=60 + step["tokens"] / 1000)
            events.emit("settled", tokens=step["tokens"], seconds=round(time.perf_counter() - began, 3),
                        complete=complete)
            continue
        prompt = {"prompt_token_ids": prompt_tokens(step["tokens"], step["seed"])}
        before = worker_loads(stats) if root else {}
        gated = root and step["path"] == "gated"  # the gate's own cost, from the scheduler's counters
        surveyed = gate_timing(stats) if gated else {}
        began = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - began
        cached = int(output.num_cached_tokens or 0)
        loaded: dict[str, int] = {}
        if root:
            deadline = time.monotonic() + 5  # the worker writes its counters a moment after the load
            while True:
                after = worker_loads(stats)
                loaded = {tier: after[tier] - before.get(tier, 0) for tier in TIERS}
                if sum(loaded.values()) >= cached // block_tokens or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        timing = gate_delta(stats, surveyed) if gated else {}
        events.emit("sample", path=step["path"], tokens=step["tokens"], rep=step["rep"], warmup=step["warmup"],
                    seconds=round(seconds, 6), cached_tokens=cached, loaded=loaded, **timing)
    compat.shutdown_engine(llm)  # stop the engine-core processes now rather than leave them to the caller
    return {}


if __name__ == "__main__":
    engine_main(calibration_phase)
