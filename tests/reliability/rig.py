"""A real reactor on a real tree, storing and loading blocks whose bytes follow from their key.

Used by the reliability tests and by ``benchmarks/soak.py``: every payload is a
pure function of its key and length, so any process can check any block it loads
(and ``expected_file`` gives the exact bytes a published file must hold).
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from pykv.blockfile import encode_block
from pykv.failures import BlockFailure, Step
from pykv.format import Geometry
from pykv.io.probe import direct_io_supported, open_backend
from pykv.media import PosixMedium
from pykv.namespace import Namespace
from pykv.reactor import FillRequest, JobResult, LoadBlock, Reactor, ReactorConfig, ReadyBlock, StoreBlock
from pykv.staging import StagingPool, slot_bytes_for
from pykv.tree import KVTree, TreeOptions

NS = Namespace(model="reliability/tiny", dtype="bfloat16", kv_layout="NHD", tokens_per_block=256)
OTHER_NS = Namespace(model="reliability/tiny", dtype="float16", kv_layout="NHD", tokens_per_block=256)
MISS = os.strerror(2)  # "No such file or directory": a block that is not (or no longer) there


def key_of(i: int, salt: str = "") -> bytes:
    """A 20-byte key (16-byte hash + 4-byte group, like vLLM's offload keys), spread over the shards."""
    return xxhash.xxh3_128_digest(f"{salt}block-{i}".encode()) + (0).to_bytes(4, "big")


def geometry_of(key: bytes, min_bytes: int, max_bytes: int) -> Geometry:
    """A deterministic size between ``min_bytes`` and ``max_bytes`` for ``key`` (not 4 KiB aligned)."""
    span = max(max_bytes - min_bytes, 1)
    length = min_bytes + int.from_bytes(key[:4], "big") % span
    segments = 2
    return Geometry(tokens=NS.tokens_per_block, segments=segments, segment_bytes=max(length // segments, 1))


def payload_of(key: bytes, length: int) -> bytes:
    """The payload of ``key``: its 32-byte seed repeated (fast to make, differs for every key)."""
    seed = xxhash.xxh3_128_digest(key) + xxhash.xxh3_128_digest(key[::-1])
    return (seed * (length // len(seed) + 1))[:length]


def expected_file(namespace: Namespace, key: bytes, geometry: Geometry) -> bytes:
    """Bytes of the file a store of ``key`` publishes, up to the creation time (bytes 144..159)."""
    return encode_block(namespace.fingerprint, key, geometry, payload_of(key, geometry.payload_length))


@dataclass
class Outcome:
    """What happened to the blocks of one job."""

    result: JobResult
    delivered: dict[int, bytes] = field(default_factory=dict)  # index -> payload (loads)
    mismatched: list[int] = field(default_factory=list)  # delivered, but not the key's bytes

    @property
    def misses(self) -> list[int]:
        return [i for i, failure in self.result.failed.items() if is_miss(failure)]

    @property
    def errors(self) -> dict[int, BlockFailure]:
        """Failures that are not plain misses."""
        return {i: f for i, f in self.result.failed.items() if not is_miss(f)}


def is_miss(failure: BlockFailure) -> bool:
    """The block's file is not (or no longer) there."""
    return failure.step is Step.OPEN and failure.errno == errno.ENOENT


class Rig:
    """A ``Reactor`` with a source that fills payloads from keys and a sink that checks them."""

    def __init__(self, root: Path | str, *, backend: str = "auto", max_payload: int = 64 * 1024, slots: int = 8,
                 verify: str = "full", namespace: Namespace = NS, options: TreeOptions | None = None,
                 create: bool = True, io_depth: int = 4, direct: bool | None = None, keep_payloads: bool = True):
        self.tree = KVTree.create(root, options) if create else KVTree(root, options)
        if create:
            self.tree.ensure_namespace(namespace)
        self.namespace = namespace
        if direct is None:
            direct = direct_io_supported(self.tree.root)[0]
        self.pool = StagingPool(slot_bytes_for(max_payload), slots)
        self.keep_payloads = keep_payloads
        self._jobs: dict[object, tuple[list[bytes], Outcome]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.reactor = Reactor(open_backend(backend, depth=4 * (io_depth + 4) + 8), self.pool,
                               PosixMedium(self.tree, direct=direct),
                               config=ReactorConfig(io_depth=io_depth, open_ahead=io_depth, verify=verify),
                               sink=self, source=self)

    # -- reactor callbacks ---------------------------------------------------------------------
    def fill(self, requests: list[FillRequest]) -> None:
        for r in requests:
            keys, _ = self._jobs[r.job]
            self.pool.payload_view(r.slot, r.length)[:] = payload_of(keys[r.index], r.length)
            self.reactor.filled(r.transfer, True)

    def deliver(self, blocks: list[ReadyBlock]) -> None:
        for b in blocks:
            keys, outcome = self._jobs[b.job]
            payload = bytes(self.pool.payload_view(b.slot, b.header.payload_length))
            if payload != payload_of(keys[b.index], len(payload)):
                outcome.mismatched.append(b.index)
            if self.keep_payloads:
                outcome.delivered[b.index] = payload
            else:
                outcome.delivered[b.index] = b""
            self.reactor.consumed(b.transfer)

    # -- jobs ----------------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        return self.tree.block_path(self.namespace.id, key)

    def store(self, keys: list[bytes], geometries: list[Geometry], timeout: float = 60) -> Outcome:
        blocks = [StoreBlock(self.path(k), self.namespace.fingerprint, k, g) for k, g in zip(keys, geometries)]
        return self._run(keys, blocks, store=True, timeout=timeout)

    def load(self, keys: list[bytes], geometries: list[Geometry | None] | None = None,
             timeout: float = 60) -> Outcome:
        geometries = geometries or [None] * len(keys)
        blocks = [LoadBlock(self.path(k), self.namespace.fingerprint, k, g) for k, g in zip(keys, geometries)]
        return self._run(keys, blocks, store=False, timeout=timeout)

    def _run(self, keys: list[bytes], blocks: list, *, store: bool, timeout: float) -> Outcome:
        job = next(self._ids)
        outcome = Outcome(JobResult(job, None, len(blocks)))  # type: ignore[arg-type]
        self._jobs[job] = (list(keys), outcome)
        (self.reactor.write if store else self.reactor.read)(job, blocks)
        outcome.result = self.reactor.wait_for(job, timeout=timeout)
        del self._jobs[job]
        return outcome

    def close(self) -> None:
        self.reactor.close()
        self.pool.close()

    def __enter__(self) -> "Rig":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def temp_files(root: Path | str) -> list[str]:
    """Every temp file under ``root`` (``*.tmp.*``), the state dir included."""
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if ".tmp." in n]


def block_files(root: Path | str) -> list[str]:
    """Every final-named block file under ``root`` (outside ``.pykv``)."""
    out = []
    for directory, dirs, names in os.walk(root):
        if directory == str(root):
            dirs[:] = [d for d in dirs if d != ".pykv"]
        out += [os.path.join(directory, n) for n in names if n.endswith(".kv")]
    return out


def tree_snapshot(root: Path | str) -> dict[str, tuple[str, int, int]]:
    """Relative path -> (type, size, mtime_ns) of every file, link and directory under ``root``.

    Directories carry no size or mtime (creating a sibling changes a directory's mtime)."""
    snap = {}
    for directory, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                snap[os.path.relpath(path, root)] = ("dir", 0, 0)
            else:
                kind = "link" if stat.S_ISLNK(st.st_mode) else "file"
                snap[os.path.relpath(path, root)] = (kind, st.st_size, st.st_mtime_ns)
    return snap
