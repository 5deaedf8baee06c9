"""Real pykv trees for the maintenance and CLI tests (blocks written with ``write_block``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pykv.auth import KeyRing
from pykv.blockfile import write_block
from pykv.format import Geometry
from pykv.maintenance.evict_record import EvictRecord, record_round
from pykv.namespace import Namespace
from pykv.tree import KVTree

NS = Namespace(model="test/model", dtype="bfloat16", kv_layout="NHD", tokens_per_block=16)
OTHER_NS = Namespace(model="test/other", dtype="float16", kv_layout="NHD", tokens_per_block=16)
GEOMETRY = Geometry(tokens=16, segments=2, segment_bytes=1000)  # 2000-byte payload, 8 KiB files
BLOCK_SIZE = 8192
HOUR = 3600


def make_tree(tmp_path: Path, *namespaces: Namespace) -> KVTree:
    tree = KVTree.create(tmp_path / "tree")
    for namespace in namespaces or (NS,):
        tree.ensure_namespace(namespace)
    return tree


def key(i: int) -> bytes:
    return (0xA5000000 + i).to_bytes(8, "big")


def add_block(tree: KVTree, k: bytes, *, namespace: Namespace = NS, published_ago: float = 2 * HOUR,
              accessed_ago: float | None = None, keys: KeyRing | None = None) -> Path:
    """Write and publish a block (signed with ``keys``); set its mtime (publication) and atime (last
    access) in the past."""
    payload = bytes((k[-1] + i) % 256 for i in range(GEOMETRY.payload_length))
    assert write_block(tree, namespace.id, k, GEOMETRY, payload, keys=keys)
    path = tree.block_path(namespace.id, k)
    now = time.time_ns()
    accessed = published_ago if accessed_ago is None else accessed_ago
    os.utime(path, ns=(now - int(accessed * 1e9), now - int(published_ago * 1e9)))
    return path


def age_dirs(tree: KVTree, seconds: float = 60) -> None:
    """Set every directory's mtime into the past (so the catalog trusts it)."""
    then = time.time_ns() - int(seconds * 1e9)
    for directory, _, _ in os.walk(tree.root):
        os.utime(directory, ns=(then, then))


def set_mtime(path: Path, ago: float) -> None:
    then = time.time_ns() - int(ago * 1e9)
    os.utime(path, ns=(then, then), follow_symlinks=False)


def record_eviction(tree: KVTree, **changes) -> None:
    """An eviction record (``.pykv/evict.json``) of a healthy round 5 s ago on a 4 MiB limit, with ``changes``."""
    now = time.time()
    fields = dict(at=now - 5, ok_at=now - 5, behind=False, tree_bytes=3 << 20, limit=4 << 20, interval_s=10.0,
                  holder="vm.1.ab", host="vm")
    record_round(tree, EvictRecord(**{**fields, **changes}))
