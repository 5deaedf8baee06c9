"""Does pykv's load path slow the Python thread that drives decoding? (issue 19, CPU proxy)

A stand-in for vLLM's model-runner thread takes "decode steps": ``--python-ms`` of pure
Python (it holds the GIL, as kernel launches in eager mode do) then ``--gpu-ms`` asleep (the
GIL released, as while the GPU computes). Its step times are measured:

- ``pykv alone`` (first): the loads with no stand-in, their GB/s only;
- ``alone``: nothing else runs;
- ``pykv threads``: pykv's reactor loads ``--block-mib`` blocks over and over in the same
  process (reactor thread, I/O threads, ``verify`` threads: what shares the engine's GIL);
- ``pykv process``: the same stream in a child process (it shares the cores, not the GIL).

With ``--python-ms 0.5 --gpu-ms 1`` the stand-in is vLLM's engine loop while a request waits for
its KV (an empty step, then ``time.sleep(0.001)``), and the loads' GB/s beside it tell what
that loop costs pykv's reactor (``--devices 8``: a device set of subdirectories).

``pykv threads`` against ``pykv process`` is what the GIL costs; ``pykv process`` against
``alone`` what the cores cost. The tree is in ``--dir`` (default /dev/shm: every read is a CPU
copy, as on the H200 host's loop devices). No GPU.

    python benchmarks/bench_gil.py [--seconds 8] [--verify full] [--engine threadpool]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pykv.bench import block_files  # noqa: E402


def python_work(units: int) -> int:
    total = 0
    for i in range(units):
        total += i * i % 7
    return total


def calibrate(ms: float) -> int:
    """Loop units that take ``ms`` of Python on this machine, alone."""
    units = 10_000
    while True:
        started = time.perf_counter()
        python_work(units)
        took = (time.perf_counter() - started) * 1e3
        if took > 20:
            return max(1, int(units * ms / took))
        units *= 2


def decode_steps(units: int, gpu_ms: float, seconds: float) -> list[float]:
    """Step times (ms) of the stand-in decode thread for ``seconds``."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        python_work(units)
        time.sleep(gpu_ms / 1e3)
        times.append((time.perf_counter() - started) * 1e3)
    return times


def load_stream(directory: str, args: argparse.Namespace, stop, loaded) -> None:
    """Store ``--blocks`` blocks once, then load them through pykv's reactor until ``stop`` is set."""
    dirs = [Path(directory)] if args.devices == 1 else [Path(directory) / f"dev{i}" for i in range(args.devices)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    with block_files(args.engine, dirs, blocks_per_device=args.blocks, block_size=args.block_mib << 20,
                     depth=args.depth, verify=args.verify, verify_threads=args.verify_threads) as files:
        files.reactor.write("store", files.stores)
        files.reactor.wait_for("store")
        rounds = 0
        while not stop.is_set():
            files.reactor.read(rounds, files.loads)
            result = files.reactor.wait_for(rounds)
            assert not result.failed, result.failed
            rounds += 1
            loaded.value += len(files.loads) * (args.block_mib << 20)


def measure(label: str, args: argparse.Namespace, units: int, stream: str | None, *, idle: bool = False) -> None:
    ctx = multiprocessing.get_context("fork")
    stop, loaded = ctx.Event(), ctx.Value("d", 0.0)
    runner = None
    if stream == "thread":
        runner = threading.Thread(target=load_stream, args=(args.dir, args, stop, loaded), daemon=True)
    elif stream == "process":
        runner = ctx.Process(target=load_stream, args=(args.dir, args, stop, loaded), daemon=True)
    if runner is not None:
        runner.start()
        deadline = time.monotonic() + 60
        while loaded.value == 0 and time.monotonic() < deadline:  # the stream is loading
            time.sleep(0.05)
    started, before = time.perf_counter(), loaded.value
    if idle:  # no stand-in: the loads alone
        time.sleep(args.seconds)
    steps = [] if idle else decode_steps(units, args.gpu_ms, args.seconds)
    rate = (loaded.value - before) / (time.perf_counter() - started) / 1e9
    stop.set()
    if runner is not None:
        runner.join(timeout=60)
    if idle:
        print(f"  {label:<14} no decode steps                                            pykv loads {rate:5.2f} GB/s",
              flush=True)
        return
    steps.sort()
    p99 = steps[min(len(steps) - 1, int(len(steps) * 0.99))]
    print(f"  {label:<14} steps {len(steps):5d}  mean {statistics.mean(steps):6.2f} ms  p50 {steps[len(steps) // 2]:6.2f}"
          f"  p99 {p99:6.2f} ms   pykv loads {rate:5.2f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--python-ms", type=float, default=1.0)
    parser.add_argument("--gpu-ms", type=float, default=4.0)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--block-mib", type=int, default=28)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--verify", default="full", choices=("full", "header"))
    parser.add_argument("--engine", default="threadpool", choices=("threadpool", "io_uring"))
    parser.add_argument("--devices", type=int, default=1, help="a device set of this many subdirectories of --dir")
    parser.add_argument("--verify-threads", type=int, default=None, help="hashing threads (default: auto)")
    args = parser.parse_args()
    units = calibrate(args.python_ms)
    print(f"decode step: {args.python_ms:g} ms of Python + {args.gpu_ms:g} ms asleep; pykv: {args.blocks} blocks of "
          f"{args.block_mib} MiB per device, {args.devices} device(s) in {args.dir}, {args.engine}, depth {args.depth}, "
          f"verify={args.verify}")
    measure("pykv alone", args, units, "thread", idle=True)
    for label, stream in (("alone", None), ("pykv threads", "thread"), ("pykv process", "process"), ("alone again", None)):
        measure(label, args, units, stream)


if __name__ == "__main__":
    main()
