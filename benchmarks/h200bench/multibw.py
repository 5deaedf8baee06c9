"""Aggregate O_DIRECT read bandwidth of several devices at once (``h200_connector.py mbw``).

One file per device directory, written first; then read passes in which every device is read at
the same time, each by its own thread with its own pykv I/O backend (``pykv.io``: io_uring or the
thread pool), staging slots and ``depth`` requests in flight (fio's ``--direct=1 --iodepth``
per device, one job per device). A pass starts for all devices together (a barrier) and its
aggregate is the bytes of all devices over the time until the last device finished; each
device's own rate is kept beside it. One ``bw`` record per pass, ``what`` =
``odirect_read_agg`` (``medium`` = ``stripe{N}`` for N devices).

Before them, the host's memory copy bandwidth (``host_copy``: threads copying their own
256 MiB buffers at once, ``what`` = ``host_copy``): a loop device in ``/dev/shm`` serves each
O_DIRECT read as a CPU copy out of tmpfs pages, so that bandwidth is what reads, checksums and
the GPU copies of a load share on this host.

Then pykv's load path without the GPU copy: the reactor storing and loading real 28 MiB block
files over all N directories as one device set (``pykv.bench.bench_files``: placement, opens,
header checks, reads, and with ``verify=full`` the checksums; ``auth``: the MACs of
``auth_key_file``), per engine and mode, ``what`` = ``files_read_agg`` / ``files_write_agg``. Beside the O_DIRECT aggregate it separates
what the reads lose from what the copy to the GPU loses in an engine's load.
"""

from __future__ import annotations

import argparse
import math
import os
import threading
import time
from pathlib import Path

from h200bench.ceiling import MODES as CEILING_MODES, ceiling_pass
from h200bench.util import close_pass, emit, log, read_pass_result

AGG_WHAT = "odirect_read_agg"
COPY_WHAT = "host_copy"
FILES_WHAT = "files_read_agg"
ONE_RING = "io_uring-one-ring"
"""The engine name of ``one_ring``'s passes (``--engines``): all devices through one ring."""
FILE_BLOCK = 28 << 20  # one 256-token block of the 3B shape
DEFAULT_CONFIGS = ((4 << 20, 16), (28 << 20, 8))
"""(request bytes, depth per device) of the read passes: the shape the device README measured."""


def transfer(engine: str, path: Path, kind: str, *, size: int, block: int, depth: int,
             start: threading.Barrier | None = None) -> tuple[float, float]:
    """Read or write ``size`` bytes of ``path`` sequentially in ``block`` requests, ``depth`` in flight;
    (start, end) ``perf_counter`` times. Backend, slots and file are set up before the clock starts
    (and before ``start``, a barrier the devices of one pass wait at)."""
    from pykv.bench import sequential_pass
    from pykv.io.backend import OpKind
    from pykv.io.probe import open_backend
    from pykv.staging import StagingPool

    op = OpKind.READ if kind == "read" else OpKind.WRITE
    flags = os.O_DIRECT | os.O_CLOEXEC | (os.O_RDONLY if kind == "read" else os.O_RDWR | os.O_CREAT)
    pool, backend, fd = StagingPool(block, depth, populate=True), None, -1
    try:
        backend = open_backend(engine, depth=depth + 2)
        fd = os.open(path, flags, 0o600)
        if start is not None:
            start.wait()
        started = time.perf_counter()
        try:
            sequential_pass(backend, pool, fd, op, size // block, block, depth)
        except OSError as exc:  # a short or failed request: name the device's file
            raise OSError(f"{path}: {exc}") from exc
        if kind == "write":
            os.fsync(fd)
        return started, time.perf_counter()
    finally:
        if fd >= 0:
            os.close(fd)
        if backend is not None:
            backend.close()
        pool.close()


def together(paths: list[Path], kind: str, *, engine: str, size: int, block: int, depth: int) -> dict:
    """One pass over every path at once (all start together); aggregate and per-device GB/s."""
    barrier = threading.Barrier(len(paths))
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(paths)
    errors: list[BaseException] = []

    def one(i: int, path: Path) -> None:
        try:
            spans[i] = transfer(engine, path, kind, size=size, block=block, depth=depth, start=barrier)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            barrier.abort()  # the others do not wait for this one

    threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(paths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    total = size * len(paths)
    return {"bytes": total, "seconds": round(wall, 4), "gb_per_s": round(total / wall / 1e9, 3),
            "per_device_gb_per_s": [round(size / (end - start) / 1e9, 3) for start, end in spans]}


def one_ring(paths: list[Path], *, size: int, block: int, depth: int) -> dict:
    """Like ``together`` for reads, but every device through one io_uring on one thread (the reactor's
    shape: one ring, ``depth`` reads in flight per device) instead of a ring and a thread each."""
    from pykv.io.backend import IoRequest, OpKind
    from pykv.io.probe import open_backend
    from pykv.staging import StagingPool

    count, blocks = len(paths), size // block
    pool, backend, fds = StagingPool(block, depth * count, populate=True), None, []
    try:
        backend = open_backend("io_uring", depth=depth * count + 2)
        fds = [os.open(p, os.O_DIRECT | os.O_CLOEXEC | os.O_RDONLY) for p in paths]
        free = [list(range(d * depth, (d + 1) * depth)) for d in range(count)]
        next_block, ends = [0] * count, [0.0] * count
        started = time.perf_counter()
        while any(n < blocks for n in next_block) or any(len(f) < depth for f in free):
            batch = []
            for d in range(count):
                while free[d] and next_block[d] < blocks:
                    slot = free[d].pop()
                    batch.append(IoRequest(OpKind.READ, (d, slot, next_block[d]), fd=fds[d],
                                           address=pool.address(slot), length=block, offset=next_block[d] * block))
                    next_block[d] += 1
            if batch:
                backend.submit(batch)
            for completion in backend.wait(1):
                d, slot, index = completion.token
                if completion.result != block:
                    raise OSError(f"{paths[d]}: read of block {index} returned {completion.result}")
                free[d].append(slot)
                if next_block[d] >= blocks and len(free[d]) == depth:
                    ends[d] = time.perf_counter()
    finally:
        close_pass(fds, backend, pool)
    return read_pass_result(size, count, started, ends)


def host_copy(threads: int, *, size: int = 256 << 20, reps: int = 4) -> dict:
    """``threads`` threads each copying its own ``size``-byte buffer ``reps`` times, started
    together (numpy releases the GIL while it copies); bytes copied per second, all together."""
    import numpy as np

    pairs = [(np.ones(size, np.uint8), np.empty(size, np.uint8)) for _ in range(threads)]
    for src, dst in pairs:  # fault every page in before timing
        np.copyto(dst, src)
    barrier = threading.Barrier(threads + 1)

    def run(src, dst) -> None:
        barrier.wait()
        for _ in range(reps):
            np.copyto(dst, src)
    workers = [threading.Thread(target=run, args=pair) for pair in pairs]
    for w in workers:
        w.start()
    barrier.wait()
    started = time.perf_counter()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    copied = threads * size * reps
    return {"threads": threads, "bytes": copied, "seconds": round(wall, 4), "gb_per_s": round(copied / wall / 1e9, 3)}


def mbw_main(a: argparse.Namespace) -> int:
    """``h200_connector.py mbw``: write one file per directory, then the read passes of every
    device count in ``--counts`` (the first N directories) and every (request, depth) config."""
    from pykv.bench import drop_page_cache

    dirs = [Path(d) for d in a.dirs.split(",") if d]
    configs = [tuple(int(x) for x in c.split(":")) for c in a.configs.split(",")] if a.configs else DEFAULT_CONFIGS
    unit = math.lcm(4 << 20, *(block for block, _ in configs))  # the write's request and every read's
    size = a.size - a.size % unit
    paths = [d / f"pykv-h200-mbw-{os.getpid()}.dat" for d in dirs]
    engines = a.engines.split(",")
    if a.files_only:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        reactor_files(a, dirs, engines)
        return 0
    for threads in [int(t) for t in a.copy_threads.split(",") if t]:
        emit(a.results, {"kind": "bw", "stage": a.stage, "what": COPY_WHAT,
                         **host_copy(threads, size=a.copy_bytes)})
    try:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        wrote = together(paths, "write", engine="threadpool", size=size, block=4 << 20, depth=16)
        emit(a.results, {"kind": "bw", "stage": a.stage, "medium": f"stripe{len(dirs)}", "what": "odirect_write_agg",
                         "devices": len(dirs), "engine": "pykv threadpool", "block": 4 << 20, "depth": 16, **wrote})
        for path in paths:
            drop_page_cache(path)
        for rep in range(a.repeat):
            for count in [int(c) for c in a.counts.split(",")]:
                for block, depth in configs:
                    for engine in engines:
                        tags = {"kind": "bw", "stage": a.stage, "medium": f"stripe{count}", "what": AGG_WHAT,
                                "devices": count, "engine": f"pykv {engine}", "block": block, "depth": depth,
                                "rep": rep}
                        try:
                            if engine == ONE_RING:
                                passed = one_ring(paths[:count], size=size, block=block, depth=depth)
                            elif engine in CEILING_MODES:
                                passed = ceiling_pass(paths[:count], engine, size=size, block=block, depth=depth)
                            else:
                                passed = together(paths[:count], "read", engine=engine, size=size, block=block,
                                                  depth=depth)
                            emit(a.results, {**tags, **passed})
                        except Exception as exc:  # noqa: BLE001 - io_uring may be refused
                            log(f"mbw {count} devices {engine}: {exc!r}")
                            emit(a.results, {**tags, "error": repr(exc)})
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    if a.files_size:
        reactor_files(a, dirs, [e for e in engines if e != ONE_RING and e not in CEILING_MODES])
    return 0


def reactor_files(a: argparse.Namespace, dirs: list[Path], engines: list[str]) -> None:
    """The reactor over block files in every directory at once, per engine and verify mode
    (``auth``: signed stores, authenticated loads with a throwaway key); the hashing modes once per
    ``--verify-threads`` count (none given: the configuration's default)."""
    import secrets
    import tempfile

    from pykv.bench import bench_files

    size = max(FILE_BLOCK, a.files_size - a.files_size % FILE_BLOCK)
    with tempfile.TemporaryDirectory(prefix="pykv-mbw-key-") as key_dir:
        key_file = os.path.join(key_dir, "auth.keys")
        modes = [m for m in a.files_modes.split(",") if m in ("header", "full")]
        if "auth" in a.files_modes.split(","):
            try:
                from pykv.auth import write_key_file
                write_key_file(key_file, {"bench": secrets.token_bytes(32)})
                modes.append("auth")
            except ImportError as exc:  # blake3 missing on this host
                log(f"reactor files: no authenticated pass ({exc})")
        thread_counts = [int(t) for t in (a.verify_threads or "").split(",") if t] or [None]
        depths = [int(d) for d in str(a.files_depth).split(",") if d]
        passes = [(mode, threads, depth) for mode in modes
                  for threads in ([None] if mode == "header" else thread_counts) for depth in depths]
        for engine in engines:
            for mode, threads, depth in passes:
                tags = {"kind": "bw", "stage": a.stage, "medium": f"stripe{len(dirs)}", "devices": len(dirs),
                        "engine": f"pykv reactor {engine}", "verify": mode, "block": FILE_BLOCK, "depth": depth,
                        **({} if threads is None else {"verify_threads": threads})}
                try:
                    runs = bench_files(engine, dirs, size=size, block_size=FILE_BLOCK, depth=depth,
                                       verify="full" if mode == "auth" else mode,
                                       auth_key_file=key_file if mode == "auth" else None, verify_threads=threads)
                except Exception as exc:  # noqa: BLE001 - io_uring may be refused
                    log(f"reactor files {len(dirs)} devices {engine} {mode}: {exc!r}")
                    emit(a.results, {**tags, "what": FILES_WHAT, "error": repr(exc)})
                    continue
                for r in runs:
                    emit(a.results, {**tags, "what": f"files_{r.op}_agg", "bytes": r.bytes,
                                     "seconds": round(r.seconds, 4), "gb_per_s": round(r.gb_per_s, 3)})


def add_mbw_parser(sub) -> None:
    p = sub.add_parser("mbw", help="(internal) aggregate O_DIRECT reads of several devices at once")
    p.add_argument("--results", required=True)
    p.add_argument("--stage", default="-")
    p.add_argument("--dirs", required=True, help="comma-separated directories, one per device")
    p.add_argument("--counts", default="1", help="device counts to read at once (the first N directories)")
    p.add_argument("--configs", help="REQUEST_BYTES:DEPTH,... (default 4 MiB:16, 28 MiB:8)")
    p.add_argument("--engines", default="io_uring,threadpool",
                   help=f"read engines: pykv backends, {ONE_RING}, {', '.join(CEILING_MODES)} (h200bench.ceiling)")
    p.add_argument("--size", type=int, default=2 << 30, help="bytes of each device's file")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--files-size", type=int, default=1 << 30,
                   help="reactor block files per device, bytes (0: no reactor pass)")
    p.add_argument("--files-depth", default="16", help="reactor: requests in flight per device (comma-separated: "
                   "a pass per depth)")
    p.add_argument("--files-modes", default="header,full,auth", help="reactor: verify modes (header, full, auth)")
    p.add_argument("--files-only", action="store_true", help="only the reactor pass (no copy probe, no raw reads)")
    p.add_argument("--verify-threads", default="", help="reactor: hashing thread counts, comma-separated "
                   "(default: the configuration's)")
    p.add_argument("--copy-threads", default="1,4,8,16", help="host memory copy probe: thread counts ('' for none)")
    p.add_argument("--copy-bytes", type=int, default=256 << 20, help="host memory copy probe: bytes per thread")
