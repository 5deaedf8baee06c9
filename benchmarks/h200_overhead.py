"""Where does a pykv engine's extra time go when it loads nothing? (H200 diagnostic)

One engine process per configuration, in-process engine core (so cProfile sees the
scheduler, the model runner and pykv's threads' effect on them):

- ``none``: no KV connector (the calibration's recompute engine);
- ``gated``: pykv, prompts stored first, then served through a gate that refuses every
  load (the calibration's gated engine at lengths below break-even);
- ``gated-uring``: the same with the io_uring backend instead of the thread pool (fewer threads);
- ``gated-8``: the io_uring engine over 8 roots (subdirectories of ``--tree``) with
  ``pykv config``'s staging, depth and verify defaults (the calibration's 8-device gated engine);
- ``gated-nhd``: the thread-pool engine with vLLM's default KV cache layout instead of the ``HND``
  layout ``OffloadingConnector`` asks for (a diagnostic patch, not a pykv setting).

Prints the median TTFT per length for each, then the functions with the most
cumulative time in one profiled pass. Usage (GPU host, after ``h200_run.sh`` setup)::

    python3 benchmarks/h200_overhead.py all --model-dir DIR --tree DIR [--lengths 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time

CONFIGS = ("none", "gated", "gated-uring", "gated-8", "gated-nhd")


def prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + tokens)
    return [rng.randrange(3, 1000) for _ in range(tokens + 1)]


def engine(config: str, args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    lengths = [int(x) for x in args.lengths.split(",")]
    kwargs = dict(model=args.model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  enable_prefix_caching=False, seed=0, max_model_len=max(lengths) + 512,
                  gpu_memory_utilization=float(os.environ.get("PYKV_OVERHEAD_GPU_UTIL", "0.5")),
                  max_num_batched_tokens=8192)
    if config != "none":
        from pykv.calibration import Calibration, TierCalibration
        from pykv.config import PykvConfig
        from pykv.connector.connector import PykvOffloadingConnector

        if config == "gated-nhd":
            PykvOffloadingConnector.get_required_kvcache_layout = classmethod(lambda cls, cfg: None)
        cal = Calibration(model="any", dtype="any", kv_layout="any",
                          tiers={"disk": TierCalibration(10**9), "dram": TierCalibration(10**9)})
        root = os.path.abspath(os.path.join(args.tree, config))
        os.makedirs(root, exist_ok=True)  # engines never create a root
        engine_name = "io_uring" if config == "gated-uring" else "threadpool"
        extra = {"root": root, "staging_bytes": "2G", "io_engine": engine_name, "io_depth": 32}
        if config == "gated-8":
            roots = [os.path.join(root, f"dev{i}") for i in range(8)]
            for r in roots:
                os.makedirs(r, exist_ok=True)
            extra = {"roots": roots, "io_engine": "io_uring"}
        extra.update(breakeven_file=str(cal.save(os.path.join(args.tree, f"{config}.cal.json"))),
                     breakeven_override=True)
        kwargs["kv_transfer_config"] = PykvConfig.from_extra_config(extra).to_kv_transfer_config(256)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(tokens: list[int]) -> float:
        began = time.perf_counter()
        llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        return time.perf_counter() - began

    for n in lengths:  # the first pass stores (pykv); the gate refuses every later load
        ttft(prompt(n, 0))
    time.sleep(5)
    ttft(prompt(lengths[0], 0))  # warm-up on a stored prompt
    result = {"config": config, "start_s": round(start_s, 1), "median_ms": {}, "samples_ms": {}}
    for n in lengths:
        samples = [ttft(prompt(n, 0)) * 1000 for _ in range(args.reps)]
        result["median_ms"][n] = round(statistics.median(samples), 2)
        result["samples_ms"][n] = [round(s, 2) for s in samples]
    profile = cProfile.Profile()
    profile.enable()
    for n in lengths:
        for _ in range(3):
            ttft(prompt(n, 0))
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
    text.write("\n--- by own time ---\n")
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    result["profile"] = text.getvalue()
    print("OVERHEAD " + json.dumps(result), flush=True)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", choices=CONFIGS + ("all",))
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tree", required=True)
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None, help="directory for overhead.jsonl and the profiles")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="with all: which configurations")
    args = parser.parse_args()
    if args.config != "all":
        engine(args.config, args)
        return
    os.makedirs(args.tree, exist_ok=True)
    rows = []
    for config in args.configs.split(","):
        cmd = [sys.executable, __file__, config, "--model-dir", args.model_dir, "--tree", args.tree,
               "--lengths", args.lengths, "--reps", str(args.reps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("OVERHEAD ")), None)
        if line is None:
            print(f"{config}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
            continue
        row = json.loads(line[len("OVERHEAD "):])
        rows.append(row)
        if args.out:
            with open(os.path.join(args.out, f"profile-{config}.txt"), "w") as f:
                f.write(row["profile"])
            with open(os.path.join(args.out, "overhead.jsonl"), "a") as f:
                f.write(json.dumps({k: v for k, v in row.items() if k != "profile"}) + "\n")
        print(config, "start", row["start_s"], "s; median ms", row["median_ms"], flush=True)
    base = next((r for r in rows if r["config"] == "none"), None)
    for row in rows:
        if base and row is not base:
            print(row["config"], "/ none:", {n: round(row["median_ms"][n] / base["median_ms"][n], 3)
                                           for n in row["median_ms"]})


if __name__ == "__main__":
    main()
