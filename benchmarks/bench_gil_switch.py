"""What the GIL switch interval costs a thread of short GIL-releasing calls beside a busy one.

One thread issues ``--ops`` small torch ops per step (each gives the GIL up and takes it back,
as a device codec's step does); another runs pure Python without pause (as vLLM's engine loop
does while requests wait for their KV). Prints the step's time alone and beside the busy thread
for each switch interval (``gil_switch_ms``), and beside a loop that runs ``--loop-us`` of Python
per step and then waits ``--idle-wait-ms`` (``idle_wait_ms``: the worker's wait on steps that run
no model). No GPU needed.

    python benchmarks/bench_gil_switch.py
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch


OP = "torch"


def step_ms(steps: int, ops: int) -> float:
    a, b = torch.zeros(16), torch.ones(16)
    began = time.perf_counter()
    for _ in range(steps):
        for _ in range(ops):
            if OP == "torch":
                a.add_(b)
            else:  # gives the GIL up whatever torch's build does
                time.sleep(0)
    return (time.perf_counter() - began) / steps * 1e3


def beside(steps: int, ops: int, spin_us: float, wait_ms: float) -> float:
    """The step's time beside a thread that runs Python for ``spin_us`` and then waits ``wait_ms``
    (0: never waits: a busy thread), over and over."""
    stop = threading.Event()

    def loop() -> None:
        x = 0
        while not stop.is_set():
            until = time.perf_counter() + spin_us / 1e6
            while time.perf_counter() < until:
                x += 1
            if wait_ms:
                stop.wait(wait_ms / 1e3)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(0.05)
    took = step_ms(steps, ops)
    stop.set()
    thread.join()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=50)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    parser.add_argument("--loop-us", type=float, default=300, help="Python the loop runs per step before a wait")
    parser.add_argument("--idle-wait-ms", default="2,10", help="the loop's waits to try (idle_wait_ms)")
    parser.add_argument("--op", choices=("torch", "sleep"), default="torch",
                        help="the short call: a small torch op (gives the GIL up in the torch builds of runs 25-26, "
                             "not in 2.13's CPU build) or time.sleep(0) (always does)")
    args = parser.parse_args()
    global OP
    OP = args.op
    waits = [float(x) for x in args.idle_wait_ms.split(",") if x]
    for ms in (float(x) for x in args.intervals_ms.split(",")):
        sys.setswitchinterval(ms / 1e3)
        alone = step_ms(args.steps, args.ops)
        busy = beside(args.steps, args.ops, args.loop_us, 0)
        waited = ", ".join(f"{beside(args.steps, args.ops, args.loop_us, w):.3f} ms beside a loop waiting {w:g} ms "
                           f"after {args.loop_us:g} us" for w in waits)
        print(f"switch interval {ms:g} ms: {args.ops} {OP} calls per step {alone:.3f} ms alone, "
              f"{busy:.3f} ms beside a busy thread{', ' if waited else ''}{waited}")


if __name__ == "__main__":
    main()
