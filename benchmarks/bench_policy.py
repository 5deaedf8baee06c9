"""CPU cost of the reactor policy per step as the number of queued blocks grows (no I/O).

N loads are queued at once (an 80k-token hit is 320 storage blocks; eight of them in flight
are 2,560); the driver completes one open and one read per step, like a reactor seeing its
completions one by one. A policy whose step cost grows with N makes a whole load O(N^2).
The second table spreads the blocks over 8 lanes (devices), each with its own depth.

    python benchmarks/bench_policy.py
"""

from __future__ import annotations

import time

from pykv.policy import Deliver, Kind, Open, ReactorPolicy, Read
from pykv.staging import SlotLedger


def drive(n: int, slots: int = 300, depth: int = 32, ahead: int = 32, lanes: int = 1) -> tuple[float, int]:
    policy = ReactorPolicy(SlotLedger(slots), depth, ahead, lanes=lanes)
    for i in range(n):
        policy.add(i, Kind.LOAD, lane=i % lanes)
    opening: list[int] = []
    reading: list[int] = []
    finished = steps = 0
    began = time.perf_counter()
    while finished < n:
        for action in policy.step():
            if isinstance(action, Open):
                opening.append(action.transfer)
            elif isinstance(action, Read):
                reading.append(action.transfer)
            elif isinstance(action, Deliver):
                for transfer, _ in action.blocks:
                    policy.consumed(transfer)
                    finished += 1
        steps += 1
        if opening:
            policy.opened(opening.pop(0), True)
        if reading:
            policy.read_done(reading.pop(0), True)
    return time.perf_counter() - began, steps


def main() -> None:
    for lanes in (1, 8):
        base = None
        print(f"{lanes} lane{'s' * (lanes > 1)}:")
        for n in (320, 1280, 2560):
            seconds, steps = drive(n, lanes=lanes)
            per_step = seconds / steps * 1e6
            base = base or per_step
            print(f"{n:5,d} blocks: {steps:5,d} steps in {seconds * 1e3:7.1f} ms, {per_step:6.1f} us per step "
                  f"({per_step / base:.2f}x the 320-block step)")


if __name__ == "__main__":
    main()
