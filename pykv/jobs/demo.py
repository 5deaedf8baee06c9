"""``pykv demo``: the same prompt twice through vLLM with pykv; the second is served from the tree.

``run_demo`` runs ``demo_job`` in an engine process of its own (``python -m
pykv.jobs.demo PLAN EVENTS``, ``PYTHONHASHSEED=0``), which makes a tiny
random-weights Llama (no hub access), starts one engine with pykv, generates from a
1,000-token prompt, waits until its blocks are published, generates again, and
returns both runs and pykv's own counters (``pykv.counters``).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from pykv.counters import ENV as COUNTERS_ENV
from pykv.counters import CounterSnapshot, read_counters
from pykv.jobs.progress import EventLog, engine_main
from pykv.jobs.runner import EngineJob, ProgressCallback

PROMPT_TOKENS = 1000
STORAGE_BLOCK_TOKENS = 256
DEADLINE_SECONDS = 1800.0
"""The demo takes a minute or two on a laptop; a run this long is stuck."""


STEPS = {"model": "tiny model written", "engine": "engine started", "run": "run {done} of 2 done",
         "stored": "the first run's blocks are in the tree"}
"""The demo's progress phases (``EventLog.progress``), as ``pykv demo`` says them."""


def run_demo(root: Path | list[Path], work: Path, log: Path, *,
             progress: ProgressCallback | None = None) -> tuple[list[dict[str, Any]], CounterSnapshot]:
    """Run the demo with its tree at ``root`` (a list: a device set, one directory per device; the
    model and counters go to ``work``, the engine's output to ``log``); its two runs and pykv's counters.
    ``progress`` hears each phase of ``STEPS`` as it ends."""
    roots = [str(r) for r in root] if isinstance(root, list) else [str(root)]
    stats = work / "stats"
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", COUNTERS_ENV: str(stats),
           "TMPDIR": str(work)}  # what vLLM leaves in the temp directory goes with the work directory
    job = EngineJob("demo", "pykv.jobs.demo", {"roots": roots, "model": str(work / "tiny-llama")}, work,
                    env=env, log=log, deadline=DEADLINE_SECONDS)
    result = job.run(progress)
    return result["runs"], read_counters(stats)


def wait_for_blocks(root: Path | list[Path], expected: int, timeout: float = 60.0) -> int:
    """Wait until ``expected`` block files are published under ``root`` (or all of a list of roots);
    return how many are."""
    deadline = time.monotonic() + timeout
    roots = root if isinstance(root, list) else [root]
    while True:
        found = sum(1 for r in roots for p in r.rglob("*.kv") if ".pykv" not in p.parts)
        if found >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def demo_job(plan: dict[str, Any], events: EventLog) -> dict[str, Any]:
    """(In the engine process) the two runs: ``{"runs": [{run, seconds, num_cached_tokens, tokens}, ...]}``."""
    from pykv.config import PykvConfig, root_keys
    from pykv.connector import compat
    from pykv.jobs.tiny_model import make_tiny_llama

    roots = [Path(r) for r in plan.get("roots") or [plan["root"]]]
    model = make_tiny_llama(Path(plan["model"]))
    events.progress("model", 1, 1)
    config = PykvConfig.from_extra_config(root_keys(roots)).to_kv_transfer_config(STORAGE_BLOCK_TOKENS)
    llm = compat.LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, block_size=32,
                     max_model_len=4096, gpu_memory_utilization=0.3, enable_prefix_caching=False, seed=0,
                     kv_transfer_config=config)
    events.progress("engine", 1, 1)
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]}
    params = compat.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for attempt in (1, 2):
        started = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        runs.append({"run": attempt, "seconds": round(time.perf_counter() - started, 3),
                     "num_cached_tokens": output.num_cached_tokens, "tokens": list(output.outputs[0].token_ids)})
        events.progress("run", attempt, 2)
        if attempt == 1:
            wait_for_blocks(roots, PROMPT_TOKENS // STORAGE_BLOCK_TOKENS)
            events.progress("stored", 1, 1)
    compat.shutdown_engine(llm)  # before os._exit: the engine core would otherwise outlive us
    return {"runs": runs}


if __name__ == "__main__":
    engine_main(demo_job)
