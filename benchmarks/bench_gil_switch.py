"""What the GIL switch interval costs a thread of short GIL-releasing calls beside a busy one.

One thread issues ``--ops`` small torch ops per step (each gives the GIL up and takes it back,
as a device codec's step does); another runs pure Python without pause (as vLLM's engine loop
does while requests wait for their KV). Prints the step's time alone and beside the busy thread
for each switch interval (``gil_switch_ms``). No GPU needed.

    python benchmarks/bench_gil_switch.py
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch


def step_ms(steps: int, ops: int) -> float:
    a, b = torch.zeros(16), torch.ones(16)
    began = time.perf_counter()
    for _ in range(steps):
        for _ in range(ops):
            a.add_(b)
    return (time.perf_counter() - began) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=50)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    args = parser.parse_args()
    for ms in (float(x) for x in args.intervals_ms.split(",")):
        sys.setswitchinterval(ms / 1e3)
        alone = step_ms(args.steps, args.ops)
        stop = threading.Event()

        def busy() -> None:
            x = 0
            while not stop.is_set():
                x += 1

        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        time.sleep(0.05)
        beside = step_ms(args.steps, args.ops)
        stop.set()
        thread.join()
        print(f"switch interval {ms:g} ms: {args.ops} torch ops per step {alone:.3f} ms alone, "
              f"{beside:.3f} ms beside a busy thread")


if __name__ == "__main__":
    main()
