"""Run several scenarios in ONE vLLM engine process and write their results as JSON.

usage: python driver.py PLAN.json RESULT.json

PLAN: {"model": dir, "kv_transfer_config": {...} | null, "prelude": code | null, "steps": [...]}
(``prelude``: test glue exec'd in-process before the engine starts, e.g. to wrap what pykv builds
at start; it matters only with VLLM_ENABLE_V1_MULTIPROCESSING=0). Each step:
  {"op": "generate", "name": str, "prompts": [[token ids], ...], "max_tokens": 8, "cache_salt": str}
      -> results[name] = [{"tokens": [...], "num_cached_tokens": n}, ...]
      (``cache_salt``, optional: vLLM's per-request salt, given with every prompt of the step)
  {"op": "settle", "stats": path, "timeout": s}  wait until the worker's counter file
      (``pykv.counters``) shows no transfer in flight and stops changing (stores are deferred and async)
  {"op": "snapshot", "name": str, "stats": path}  results[name] = the counter files, by role
  {"op": "mark", "name": str}  remember the time (for "corrupt" ... "since")
  {"op": "corrupt", "root": dir, "mode": "flip"|"truncate", "since": mark|null, "count": n|null}
      flip: XOR every payload byte with 0x55; only block files published after the mark
      -> results["corrupted"] += paths touched
  {"op": "wait_files", "root": dir, "count": n, "timeout": s}  wait for n block files
  {"op": "exec", "code": str}  exec arbitrary test glue (mount tricks, chmod) in-process
  {"op": "sleep", "seconds": s}
  {"op": "kv_digest", "name": str, "of": generate step, "blocks": n}  results[name] = the xxh3 of each of
      the first n engine blocks of that step's (first) request, as its KV cache holds them now: every
      layer's bytes of that block. Needs the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), where
      each generate result also lists its request's engine block ids ("blocks").
The engine starts under ``if __name__ == "__main__"`` as vLLM's CPU build requires.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def read_stats(path: str) -> dict:
    """Every counter file the pykv processes wrote under ``path`` (roles: worker ranks, scheduler)."""
    from pykv.counters import read_counters
    return read_counters(path).roles


def settle(path: str, timeout: float) -> dict:
    """Wait until no worker has a transfer in flight and the counters stop changing."""
    from pykv.jobs.settle import wait_until_quiet
    return wait_until_quiet(path, timeout, interval=0.5, pending_stores=False)[1].roles


def block_files(root: str) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*.kv") if p.is_file() and ".pykv" not in p.parts)


def corrupt(root: str, mode: str, since: float | None, count: int | None) -> list[str]:
    import numpy as np
    from pykv.format import HEADER_SIZE
    files = [p for p in block_files(root) if since is None or p.stat().st_mtime >= since]
    touched = []
    for path in files[:count] if count else files:
        if mode == "flip":
            with open(path, "r+b") as f:
                f.seek(HEADER_SIZE)
                payload = np.frombuffer(f.read(), dtype=np.uint8) ^ np.uint8(0x55)
                f.seek(HEADER_SIZE)
                f.write(payload.tobytes())
        elif mode == "truncate":
            os.truncate(path, HEADER_SIZE + 4096)
        touched.append(str(path))
    return touched


class KVPages:
    """The engine's own KV cache, read in-process: which blocks each request got, and their bytes."""

    def __init__(self, llm) -> None:
        core = llm.llm_engine.engine_core.engine_core  # the in-process EngineCore
        self.manager = core.scheduler.kv_cache_manager
        self.caches = core.model_executor.driver_worker.worker.model_runner.kv_caches
        self.num_blocks = core.scheduler.kv_cache_config.num_blocks
        self.blocks: dict[str, list[int]] = {}
        allocate = self.manager.allocate_slots

        def recording_allocate(request, *args, **kwargs):
            result = allocate(request, *args, **kwargs)
            self.blocks[request.request_id] = list(self.manager.get_block_ids(request.request_id)[0])
            return result
        self.manager.allocate_slots = recording_allocate

    def of(self, request_id: str) -> list[int] | None:
        """The engine blocks of an output's request (the engine's id may add a suffix to the output's)."""
        for engine_id, blocks in self.blocks.items():
            if engine_id == request_id or engine_id.startswith(request_id + "-"):
                return blocks
        return None

    def digests(self, block_ids: list[int], codec: str | None = None) -> list[str]:
        """``codec`` (``fp8``): digests of what a lossy codec gives back for these blocks' KV (its
        encode then decode of each block's bytes; fp8's groups of 64 values are whole head vectors
        of the test model, so any layout gives the values a load of the stored block writes)."""
        import torch
        import xxhash
        lossy = None
        if codec is not None:
            from pykv.codec import codec_for
            lossy = codec_for(codec)
        out = []
        for block in block_ids:
            digest = xxhash.xxh3_64()
            for cache in self.caches:
                dim = list(cache.shape).index(self.num_blocks)  # the block dimension of this layout
                data = cache.select(dim, block).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                digest.update(data if lossy is None else lossy.decode_bytes(lossy.encode(data), len(data)))
            out.append(digest.hexdigest())
        return out


def main(plan_path: str, result_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    from pykv.connector import compat
    from pykv.connector.compat import LLM, SamplingParams

    kwargs = dict(model=plan["model"], skip_tokenizer_init=True, enforce_eager=True, block_size=32,
                  max_model_len=4096, gpu_memory_utilization=0.3, enable_prefix_caching=False, seed=0)
    if plan.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = plan["kv_transfer_config"]
    kwargs.update(plan.get("engine", {}))
    if plan.get("prelude"):
        exec(plan["prelude"], {"os": os, "Path": Path})
    started = time.monotonic()
    llm = LLM(**kwargs)
    results: dict = {"engine_start_s": round(time.monotonic() - started, 1), "corrupted": []}
    pages = KVPages(llm) if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else None
    for step in plan["steps"]:
        op = step["op"]
        if op == "generate":
            params = SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 8), ignore_eos=True)
            salt = {"cache_salt": step["cache_salt"]} if step.get("cache_salt") else {}
            outputs = llm.generate([{"prompt_token_ids": p, **salt} for p in step["prompts"]], params,
                                   use_tqdm=False)
            results[step["name"]] = [{"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                                      **({"blocks": pages.of(o.request_id)} if pages else {})}
                                     for o in outputs]
        elif op == "kv_digest":
            if pages is None:
                raise ValueError("kv_digest needs VLLM_ENABLE_V1_MULTIPROCESSING=0")
            results[step["name"]] = pages.digests(results[step["of"]][0]["blocks"][:step["blocks"]], step.get("codec"))
        elif op == "settle":
            settle(step["stats"], step.get("timeout", 30))
        elif op == "snapshot":
            results[step["name"]] = read_stats(step["stats"])
        elif op == "mark":
            results.setdefault("marks", {})[step["name"]] = time.time() - 0.01
        elif op == "corrupt":
            since = results.get("marks", {}).get(step["since"]) if step.get("since") else None
            results["corrupted"] += corrupt(step["root"], step.get("mode", "flip"), since, step.get("count"))
        elif op == "wait_files":
            deadline = time.monotonic() + step.get("timeout", 120)
            while len(block_files(step["root"])) < step["count"] and time.monotonic() < deadline:
                time.sleep(0.5)
        elif op == "exec":
            exec(step["code"], {"results": results, "os": os, "Path": Path})
        elif op == "sleep":
            time.sleep(step["seconds"])
        else:
            raise ValueError(f"unknown op {op!r}")
        Path(result_path).write_text(json.dumps(results, indent=1))
    # vLLM's shutdown before os._exit: the engine core ends its connector (pykv's evictor finishes
    # its round and removes its lease temp) instead of outliving this script while a test reads the tree
    compat.shutdown_engine(llm)
    del llm, pages
    Path(result_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    os._exit(0)  # skip slow interpreter teardown of the engine's threads
