"""Throughput benchmarks of the I/O engines: the numbers behind ``pykv bench``.

Two measurements share the staging pool and backends with the connector:

* ``raw``: sequential O_DIRECT writes, then reads, of one file in ``block_size``
  requests with ``depth`` in flight, through an I/O backend and staging slots;
  comparable one to one with fio's ``--rw=write|read --direct=1 --iodepth``.
* ``files``: the reactor storing and loading ``size / block_size`` real block
  files (header, checksum, publication, verification) in a temp tree.

The page cache is bypassed by O_DIRECT; ``drop_page_cache`` additionally evicts
the file's pages before each read pass when possible.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from pykv.format import HEADER_SIZE, Geometry
from pykv.io.backend import IoRequest, OpKind
from pykv.config import PykvConfig
from pykv.io.probe import open_backend
from pykv.namespace import Namespace
from pykv.reactor import FillRequest, LoadBlock, Reactor, ReadyBlock, StoreBlock
from pykv.staging import StagingPool, slot_bytes_for
from pykv.deviceset import DeviceSet
from pykv.store import build_reactor
from pykv.tree import KVTree


@dataclass(frozen=True)
class BenchResult:
    """One measured pass."""

    engine: str
    op: str  # "read" | "write"
    depth: int
    block_size: int
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "gb_per_s": round(self.gb_per_s, 4)}


def bench_raw(engine: str, path: Path, *, size: int, block_size: int, depth: int) -> list[BenchResult]:
    """Write ``path`` then read it back with backend ``engine`` ("io_uring" | "threadpool")."""
    blocks = size // block_size
    pool = StagingPool(block_size, depth)
    backend = open_backend(engine, depth=depth + 2)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            results = []
            for op in ("write", "read"):
                if op == "read":
                    drop_page_cache(path)
                kind = OpKind.WRITE if op == "write" else OpKind.READ
                started = time.perf_counter()
                moved = _sequential(backend, pool, fd, kind, blocks, block_size, depth)
                if op == "write":
                    os.fsync(fd)
                results.append(BenchResult(f"pykv {backend.name}", op, depth, block_size, moved,
                                           time.perf_counter() - started))
        finally:
            os.close(fd)
    finally:
        backend.close()
        pool.close()
    return results


def _sequential(backend, pool: StagingPool, fd: int, kind: OpKind, blocks: int, block_size: int,
                depth: int) -> int:
    next_block, moved, free = 0, 0, list(range(depth))
    while next_block < blocks or len(free) < depth:
        batch = []
        while free and next_block < blocks:
            slot = free.pop()
            batch.append(IoRequest(kind, (slot, next_block), fd=fd, address=pool.address(slot),
                                   length=block_size, offset=next_block * block_size))
            next_block += 1
        if batch:
            backend.submit(batch)
        for completion in backend.wait(1):
            slot, block = completion.token
            if completion.result != block_size:
                raise OSError(f"{kind.value} of block {block} returned {completion.result}")
            moved += completion.result
            free.append(slot)
    return moved


class _ZeroSource:
    """The bench's store source and load sink: stores write whatever the slot holds and loaded
    blocks are released at once (the bench measures I/O, not copies)."""

    reactor: Reactor

    def fill(self, requests: list[FillRequest]) -> None:
        for request in requests:
            self.reactor.filled(request.transfer, True)

    def deliver(self, blocks: list[ReadyBlock]) -> None:
        for block in blocks:
            self.reactor.consumed(block.transfer)


def bench_files(engine: str, directory: Path, *, size: int, block_size: int, depth: int,
                verify: str = "header", read_segment: int = 0) -> list[BenchResult]:
    """Store then load ``size // block_size`` block files through the reactor."""
    payload = block_size - HEADER_SIZE
    geometry = Geometry(tokens=256, segments=1, segment_bytes=payload)
    namespace = Namespace("pykv-bench", "uint8", "raw", 256)
    root = Path(tempfile.mkdtemp(prefix="pykv-bench-tree-", dir=directory))
    tree = KVTree.create(root)
    tree.ensure_namespace(namespace)
    pool = StagingPool(slot_bytes_for(payload), depth * 2)
    source = _ZeroSource()
    settings = PykvConfig(root=str(root), io_engine=engine, io_depth=depth, open_ahead=2 * depth, verify=verify,
                          read_segment_bytes=read_segment)
    reactor = source.reactor = build_reactor(settings, pool, DeviceSet([tree]), client=source)
    keys = [i.to_bytes(8, "big") * 4 for i in range(size // block_size)]
    medium = reactor.medium
    stores = [StoreBlock(medium.locate(namespace.id, k), namespace.fingerprint, k, geometry) for k in keys]
    loads = [LoadBlock(b.path, b.namespace, b.key, geometry) for b in stores]
    try:
        name = f"pykv reactor files ({reactor.backend.name}"
        name += "" if medium.opens_direct else ", buffered: no O_DIRECT here"
        name += f", reads in {read_segment >> 10} KiB pieces)" if read_segment else ")"
        stored = _timed(reactor, "store", stores)
        for block in stores:
            drop_page_cache(block.path)
        loaded = _timed(reactor, "load", loads)
        for result in (stored, loaded):
            if result.failed:
                raise OSError(f"bench {result.kind.value} failed: {next(iter(result.failed.values()))}")
        return [BenchResult(name, "write", depth, block_size, stored.bytes, stored.seconds),
                BenchResult(name, "read", depth, block_size, loaded.bytes, loaded.seconds)]
    finally:
        reactor.close()
        pool.close()
        shutil.rmtree(root, ignore_errors=True)


def _timed(reactor: Reactor, job: str, blocks: list) -> "object":
    if job == "store":
        reactor.submit_store(job, blocks)
    else:
        reactor.submit_load(job, blocks)
    return reactor.wait_for(job)


def fio_available() -> bool:
    return shutil.which("fio") is not None


def bench_fio(path: Path, *, size: int, block_size: int, depth: int, engine: str = "io_uring") -> list[BenchResult]:
    """fio with the same file, request size, depth and O_DIRECT, write then read."""
    results = []
    for op in ("write", "read"):
        if op == "read":
            drop_page_cache(path)
        command = ["fio", "--name=pykv", f"--filename={path}", f"--rw={op}", f"--bs={block_size}",
                   f"--size={size}", f"--iodepth={depth}", "--direct=1", f"--ioengine={engine}",
                   "--output-format=json", "--end_fsync=1" if op == "write" else "--invalidate=1"]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        job = json.loads(output[output.index("{"):])["jobs"][0][op]
        seconds = job["runtime"] / 1000 if job["runtime"] else job["io_bytes"] / max(job["bw_bytes"], 1)
        results.append(BenchResult(f"fio {engine}", op, depth, block_size, job["io_bytes"], seconds))
    return results


def drop_page_cache(path: Path) -> None:
    """Evict ``path``'s pages from the page cache (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_bench(directory: Path, *, depths: list[int], block_size: int, size: int, repeat: int = 1,
              engines: tuple[str, ...] = ("io_uring", "threadpool"), with_fio: bool = True,
              with_files: bool = True, read_segment: int = 0,
              progress: Callable[[str, int, int], None] | None = None) -> list[BenchResult]:
    """Every engine at every depth, side by side on one file; the median of ``repeat`` passes.

    The file is written once untimed first, so every write pass overwrites allocated blocks.
    ``progress(step, done, total)`` is called before each measurement (and once at the end).
    """
    use_fio = with_fio and fio_available()
    steps = [(depth, name) for depth in depths for _ in range(repeat)
             for name in (*engines, *(("fio",) if use_fio else ()), *(("files",) if with_files else ()))]
    report = progress or (lambda step, done, total: None)
    done = 0

    def step(depth: int, name: str) -> None:
        nonlocal done
        report(f"depth {depth}: {name}", done, len(steps))
        done += 1

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"pykv-bench-{os.getpid()}.dat"
    results: list[BenchResult] = []
    try:
        bench_raw(engines[0], path, size=size, block_size=block_size, depth=depths[0])  # allocate, untimed
        for depth in depths:
            passes: dict[tuple[str, str], list[BenchResult]] = {}
            for _ in range(repeat):
                runs = []
                for engine in engines:
                    step(depth, engine)
                    runs += bench_raw(engine, path, size=size, block_size=block_size, depth=depth)
                if use_fio:
                    step(depth, "fio")
                    runs += bench_fio(path, size=size, block_size=block_size, depth=depth)
                if with_files:
                    step(depth, "files")
                    runs += bench_files(engines[0], directory, size=size, block_size=block_size, depth=depth,
                                        read_segment=read_segment)
                for r in runs:
                    passes.setdefault((r.engine, r.op), []).append(r)
            for runs in passes.values():
                results.append(sorted(runs, key=lambda r: r.gb_per_s)[len(runs) // 2])
        report("done", len(steps), len(steps))
    finally:
        path.unlink(missing_ok=True)
    return results
