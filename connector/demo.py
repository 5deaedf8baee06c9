"""The same prompt twice through vLLM with pykv: the second is served from the tree.

Run as ``python -m pykv.connector.demo --root DIR --work DIR --out FILE`` (``pykv demo``
does this in a subprocess, with ``PYTHONHASHSEED=0``): makes a tiny random-weights
Llama (no hub access), starts one engine with pykv, generates from a
1,000-token prompt, waits until its blocks are published, generates again, and
writes both results and pykv's own counters to FILE as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

PROMPT_TOKENS = 1000
STORAGE_BLOCK_TOKENS = 256


def wait_for_blocks(root: Path, expected: int, timeout: float = 60.0) -> int:
    """Wait until ``expected`` block files are published under ``root``; return how many are."""
    deadline = time.monotonic() + timeout
    while True:
        found = sum(1 for p in root.rglob("*.kv") if ".pykv" not in p.parts)
        if found >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def read_counters(stats_base: str) -> dict[str, dict]:
    """Counters each pykv process wrote (``PYKV_STATS_FILE``)."""
    base = Path(stats_base)
    return {p.name[len(base.name) + 1:-5]: json.loads(p.read_text()) for p in base.parent.glob(base.name + ".*.json")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    args = parser.parse_args()

    from pykv.connector.compat import LLM, SamplingParams

    from pykv.connector import compat
    from pykv.config import PykvConfig
    from pykv.connector.tiny_model import make_tiny_llama

    model = make_tiny_llama(args.work / "tiny-llama")
    config = PykvConfig.from_extra_config({"root": str(args.root)}).to_kv_transfer_config(STORAGE_BLOCK_TOKENS)
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=4096,
              gpu_memory_utilization=0.3, enable_prefix_caching=False, seed=0, kv_transfer_config=config)
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for attempt in (1, 2):
        started = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        runs.append({"run": attempt, "seconds": round(time.perf_counter() - started, 3),
                     "num_cached_tokens": output.num_cached_tokens, "tokens": list(output.outputs[0].token_ids)})
        if attempt == 1:
            wait_for_blocks(args.root, PROMPT_TOKENS // STORAGE_BLOCK_TOKENS)
    counters = read_counters(os.environ["PYKV_STATS_FILE"]) if "PYKV_STATS_FILE" in os.environ else {}
    args.out.write_text(json.dumps({"runs": runs, "counters": counters}))
    compat.shutdown_engine(llm)  # before os._exit: the engine core would otherwise outlive us


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the slow teardown of the engine's threads
