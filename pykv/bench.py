"""Throughput benchmarks of the I/O engines: the numbers behind ``pykv bench``.

Two measurements share the staging pool and backends with the connector:

* ``raw``: sequential O_DIRECT writes, then reads, of one file in ``block_size``
  requests with ``depth`` in flight, through an I/O backend and staging slots;
  comparable one to one with fio's ``--rw=write|read --direct=1 --iodepth``.
* ``files``: the reactor storing and loading ``size / block_size`` real block
  files (header, checksum, publication, verification) in a temp tree.

Over several directories, one per device, ``raw`` and fio run on all devices at once
(a file, a backend and ``depth`` in flight on each: the aggregate) and on each alone;
``files`` runs one reactor over a ``DeviceSet`` of temp trees, as an engine would.

The page cache is bypassed by O_DIRECT; ``drop_page_cache`` additionally evicts
the file's pages before each read pass when possible.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

from pykv.format import HEADER_SIZE, Geometry
from pykv.io.backend import IoRequest, OpKind
from pykv.config import PykvConfig, root_keys
from pykv.io.probe import open_backend
from pykv.namespace import Namespace
from pykv.reactor import FillRequest, LoadBlock, Reactor, ReadyBlock, StoreBlock
from pykv.staging import StagingPool, slot_bytes_for
from pykv.deviceset import DeviceSet
from pykv.store import build_reactor
from pykv.tree import KVTree


@dataclass(frozen=True)
class BenchResult:
    """One measured pass. ``device``: None for the one directory measured; over a device set, the
    directory measured alone, or ``all`` for every device at once (bytes summed)."""

    engine: str
    op: str  # "read" | "write"
    depth: int  # per device
    block_size: int
    bytes: int
    seconds: float
    device: str | None = None

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        data = {**asdict(self), "gb_per_s": round(self.gb_per_s, 4)}
        if self.device is None:
            del data["device"]
        return data


class _RawFile:
    """One test file on one device, with its own backend and staging slots."""

    def __init__(self, engine: str, path: Path, *, blocks: int, block_size: int, depth: int) -> None:
        self.path, self.blocks, self.block_size, self.depth = path, blocks, block_size, depth
        self.pool = StagingPool(block_size, depth, populate=True)
        self.backend, self.fd = None, -1
        try:
            self.backend = open_backend(engine, depth=depth + 2)
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        except BaseException:
            self.close()
            raise

    def run(self, kind: OpKind) -> int:
        moved = sequential_pass(self.backend, self.pool, self.fd, kind, self.blocks, self.block_size, self.depth)
        if kind is OpKind.WRITE:
            os.fsync(self.fd)
        return moved

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        if self.backend is not None:
            self.backend.close()
        self.pool.close()


def bench_raw(engine: str, path: Path, *, size: int, block_size: int, depth: int) -> list[BenchResult]:
    """Write ``path`` then read it back with backend ``engine`` ("io_uring" | "threadpool")."""
    return bench_raw_set(engine, [path], size=size, block_size=block_size, depth=depth)


def bench_raw_set(engine: str, paths: Sequence[Path], *, size: int, block_size: int, depth: int,
                  device: str | None = None) -> list[BenchResult]:
    """``bench_raw`` of one file per device, all at once (a backend and ``depth`` in flight each, one
    thread per device): per pass the bytes of all files and the time until the last one finished."""
    files: list[_RawFile] = []
    try:
        for path in paths:
            files.append(_RawFile(engine, path, blocks=size // block_size, block_size=block_size, depth=depth))
        results = []
        for op in ("write", "read"):
            if op == "read":
                for file in files:
                    drop_page_cache(file.path)
            kind = OpKind.WRITE if op == "write" else OpKind.READ
            started = time.perf_counter()
            moved = sum(all_at_once([lambda f=file: f.run(kind) for file in files]))
            results.append(BenchResult(f"pykv {files[0].backend.name}", op, depth, block_size, moved,
                                       time.perf_counter() - started, device))
        return results
    finally:
        for file in files:
            file.close()


def all_at_once(calls: Sequence[Callable[[], int]]) -> list[int]:
    """Run ``calls`` together, one thread each (one: in this thread); their results, first error raised."""
    if len(calls) == 1:
        return [calls[0]()]
    with ThreadPoolExecutor(len(calls), thread_name_prefix="pykv-bench") as pool:
        return list(pool.map(lambda call: call(), calls))


def sequential_pass(backend, pool: StagingPool, fd: int, kind: OpKind, blocks: int, block_size: int,
                    depth: int) -> int:
    """Read or write ``blocks`` requests of ``block_size`` bytes of ``fd`` in order, ``depth`` in flight
    (slots ``0..depth-1`` of ``pool``); the bytes moved. ``OSError`` on a short or failed request."""
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


@dataclass(frozen=True)
class BlockFiles:
    """A reactor built as an engine builds it, over temp trees, and the blocks to store and load."""

    reactor: Reactor
    stores: list[StoreBlock]
    loads: list[LoadBlock]


@contextlib.contextmanager
def block_files(engine: str, directories: Sequence[Path], *, blocks_per_device: int, block_size: int, depth: int,
                verify: str = "header", read_segment: int = 0,
                auth_key_file: str | None = None, verify_threads: int | None = None) -> Iterator[BlockFiles]:
    """A temp tree in each of ``directories`` (one ``DeviceSet``, blocks placed as an engine's are),
    a reactor over it with ``depth`` in flight per device and populated staging (as an engine's
    pinned slots), and exactly ``blocks_per_device`` blocks on each device (keys picked so that
    placement spreads them evenly: the pass measures the reactor against the raw probe's equal
    bytes per device, not the luck of the hash) of ``block_size`` bytes; the reactor, the staging
    and the trees are gone afterwards. ``auth_key_file``: stores signed, loads authenticated;
    ``verify_threads``: the hashing threads (None: the configuration's default)."""
    payload = block_size - HEADER_SIZE
    geometry = Geometry(tokens=256, segments=1, segment_bytes=payload)
    namespace = Namespace("pykv-bench", "uint8", "raw", 256)
    roots: list[Path] = []
    try:
        roots += [Path(tempfile.mkdtemp(prefix="pykv-bench-tree-", dir=d)) for d in directories]
        devices = DeviceSet([KVTree.create(root) for root in roots])
        devices.ensure_namespace(namespace)
        pool = StagingPool(slot_bytes_for(payload), depth * 2 * len(roots), populate=True)
        try:
            source = _ZeroSource()
            settings = PykvConfig(**root_keys(roots), io_engine=engine, io_depth=depth, open_ahead=2 * depth,
                                  verify=verify, read_segment_bytes=read_segment, auth_key_file=auth_key_file,
                                  **({} if verify_threads is None else {"verify_threads": verify_threads}))
            reactor = source.reactor = build_reactor(settings, pool, devices, client=source)
            try:
                keys = even_keys(reactor.medium, namespace.id, blocks_per_device)
                stores = [StoreBlock(reactor.medium.locate(namespace.id, k), namespace.fingerprint, k, geometry)
                          for k in keys]
                yield BlockFiles(reactor, stores, [LoadBlock(b.path, b.namespace, b.key, geometry) for b in stores])
            finally:
                reactor.close()
        finally:
            pool.close()
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def even_keys(medium, namespace_id: str, per_device: int) -> list[bytes]:
    """``per_device`` block keys for each device of ``medium``, as the medium places them."""
    counts, keys = [0] * medium.lanes, []
    for i in range(64 * per_device * medium.lanes + 64):
        key = i.to_bytes(8, "big") * 4
        lane = medium.lane(medium.locate(namespace_id, key))
        if counts[lane] < per_device:
            counts[lane] += 1
            keys.append(key)
            if len(keys) == per_device * medium.lanes:
                return keys
    raise RuntimeError(f"placement put too few of {64 * per_device * medium.lanes} keys on some device: {counts}")


def bench_files(engine: str, directory: Path | Sequence[Path], *, size: int, block_size: int, depth: int,
                verify: str = "header", read_segment: int = 0, device: str | None = None,
                auth_key_file: str | None = None, verify_threads: int | None = None) -> list[BenchResult]:
    """Store then load ``size // block_size`` block files per device through the reactor
    (``block_files``). Several directories: ``size`` and ``depth`` in flight per device."""
    directories = [directory] if isinstance(directory, Path) else list(directory)
    with block_files(engine, directories, blocks_per_device=size // block_size, block_size=block_size, depth=depth,
                     verify=verify, read_segment=read_segment, auth_key_file=auth_key_file,
                     verify_threads=verify_threads) as files:
        reactor, medium = files.reactor, files.reactor.medium
        name = f"pykv reactor files ({reactor.backend.name}"
        name += "" if medium.opens_direct else ", buffered: no O_DIRECT here"
        name += f", reads in {read_segment >> 10} KiB pieces)" if read_segment else ")"
        stored = _timed(reactor, "store", files.stores)
        for block in files.stores:
            drop_page_cache(block.path)
        loaded = _timed(reactor, "load", files.loads)
        for result in (stored, loaded):
            if result.failed:
                raise OSError(f"bench {result.kind.value} failed: {next(iter(result.failed.values()))}")
        return [BenchResult(name, "write", depth, block_size, stored.bytes, stored.seconds, device),
                BenchResult(name, "read", depth, block_size, loaded.bytes, loaded.seconds, device)]


def _timed(reactor: Reactor, job: str, blocks: list) -> "object":
    if job == "store":
        reactor.write(job, blocks)
    else:
        reactor.read(job, blocks)
    return reactor.wait_for(job)


def fio_available() -> bool:
    return shutil.which("fio") is not None


def bench_fio(path: Path | Sequence[Path], *, size: int, block_size: int, depth: int, engine: str = "io_uring",
              device: str | None = None) -> list[BenchResult]:
    """fio with the same file, request size, depth and O_DIRECT, write then read. Several files:
    one fio job per file, all at once, reported as a group (``size`` and ``depth`` per file)."""
    paths = [path] if isinstance(path, Path) else list(path)
    results = []
    for op in ("write", "read"):
        if op == "read":
            for file in paths:
                drop_page_cache(file)
        command = ["fio", "--name=pykv", f"--filename={paths[0]}", f"--rw={op}", f"--bs={block_size}",
                   f"--size={size}", f"--iodepth={depth}", "--direct=1", f"--ioengine={engine}",
                   "--output-format=json", "--end_fsync=1" if op == "write" else "--invalidate=1"]
        if len(paths) > 1:  # the options above apply to every job; each further --name starts one
            command += ["--group_reporting"] + [arg for i, file in enumerate(paths[1:], start=1)
                                                for arg in (f"--name=pykv{i}", f"--filename={file}")]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        job = json.loads(output[output.index("{"):])["jobs"][0][op]
        seconds = job["runtime"] / 1000 if job["runtime"] else job["io_bytes"] / max(job["bw_bytes"], 1)
        results.append(BenchResult(f"fio {engine}", op, depth, block_size, job["io_bytes"], seconds, device))
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


def run_bench(directory: Path | Sequence[Path], *, depths: list[int], block_size: int, size: int, repeat: int = 1,
              engines: tuple[str, ...] = ("io_uring", "threadpool"), with_fio: bool = True,
              with_files: bool = True, read_segment: int = 0,
              progress: Callable[[str, int, int], None] | None = None) -> list[BenchResult]:
    """Every engine at every depth, side by side on one file; the median of ``repeat`` passes.

    Several directories (one per device): every engine and fio on all devices at once (``device``
    ``all``; ``size`` and ``depth`` per device), then on each device alone (``device``: its
    directory); the reactor's files over all of them as one device set. The file is written once
    untimed first, so every write pass overwrites allocated blocks. ``progress(step, done, total)``
    is called before each measurement (and once at the end).
    """
    directories = [directory] if isinstance(directory, Path) else list(directory)
    use_fio = with_fio and fio_available()
    paths = [d / f"pykv-bench-{os.getpid()}.dat" for d in directories]
    # (device label, its files): one directory is measured as before; a set all at once, then each alone
    targets: list[tuple[str | None, list[Path]]] = [(None, paths)] if len(paths) == 1 else \
        [("all", paths)] + [(str(d), [p]) for d, p in zip(directories, paths)]
    names = (*engines, *(("fio",) if use_fio else ()))
    steps = [(depth, name, label) for depth in depths for _ in range(repeat) for label, _ in targets for name in names]
    steps += [(depth, "files", targets[0][0]) for depth in depths for _ in range(repeat)] if with_files else []
    report = progress or (lambda step, done, total: None)
    done = 0

    def step(depth: int, name: str, label: str | None) -> None:
        nonlocal done
        report(f"depth {depth}: {name}" + (f" ({label})" if label else ""), done, len(steps))
        done += 1

    for d in directories:
        d.mkdir(parents=True, exist_ok=True)
    results: list[BenchResult] = []
    try:
        bench_raw_set(engines[0], paths, size=size, block_size=block_size, depth=depths[0])  # allocate, untimed
        for depth in depths:
            passes: dict[tuple[str, str, str | None], list[BenchResult]] = {}
            for _ in range(repeat):
                runs = []
                for label, files in targets:
                    for engine in engines:
                        step(depth, engine, label)
                        runs += bench_raw_set(engine, files, size=size, block_size=block_size, depth=depth,
                                              device=label)
                    if use_fio:
                        step(depth, "fio", label)
                        runs += bench_fio(files, size=size, block_size=block_size, depth=depth, device=label)
                if with_files:
                    step(depth, "files", targets[0][0])
                    runs += bench_files(engines[0], directories, size=size, block_size=block_size, depth=depth,
                                        read_segment=read_segment, device=targets[0][0])
                for r in runs:
                    passes.setdefault((r.engine, r.op, r.device), []).append(r)
            for runs in passes.values():
                results.append(sorted(runs, key=lambda r: r.gb_per_s)[len(runs) // 2])
        report("done", len(steps), len(steps))
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    return results
