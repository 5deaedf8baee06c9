"""Concurrent publication: processes racing on the same keys leave one file per key (pykv/tree.py)."""

from __future__ import annotations

import os
import random
import traceback
from collections import Counter
from pathlib import Path

import xxhash

from pykv.blockfile import check_block, read_payload, write_block
from pykv.format import Geometry
from pykv.namespace import Namespace
from pykv.tree import BLOCK_SUFFIX, KVTree, is_temp_name
from reliability.racing import race

WORKERS = 4
KEYS = 200
NS = Namespace(model="m", dtype="bfloat16", kv_layout="NHD", tokens_per_block=16)


def key_of(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"block-{i}".encode())  # spread over the shard directories


def block_of(i: int) -> tuple[Geometry, bytes]:
    """Identical bytes for key ``i`` in every worker; sizes vary across keys."""
    segment_bytes = 64 + 37 * (i % 11)
    geometry = Geometry(tokens=16, segments=2, segment_bytes=segment_bytes)
    payload = (key_of(i) * (geometry.payload_length // 16 + 1))[:geometry.payload_length]
    return geometry, payload


def publish_all(root: str, seed: int, start, results) -> None:
    """Worker: write every key in a worker-specific order; report (won, lost, errors)."""
    won, lost, errors = 0, 0, []
    try:
        tree = KVTree.open(root)
        order = list(range(KEYS))
        random.Random(seed).shuffle(order)
        start.wait(timeout=60)
        for i in order:
            geometry, payload = block_of(i)
            try:
                if write_block(tree, NS.id, key_of(i), geometry, payload):
                    won += 1
                else:
                    lost += 1
            except Exception:  # noqa: BLE001 - reported to the parent
                errors.append(f"key {i}: {traceback.format_exc()}")
    except Exception:  # noqa: BLE001
        errors.append(traceback.format_exc())
    results.put((seed, os.getpid(), won, lost, errors))


def test_four_processes_publishing_the_same_keys(tmp_path: Path):
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    reports, exit_codes = race(publish_all, [(str(tree.root), seed) for seed in range(WORKERS)])
    assert exit_codes == [0] * WORKERS
    assert len({pid for _, pid, *_ in reports}) == WORKERS

    errors = [e for *_, worker_errors in reports for e in worker_errors]
    assert errors == []
    for _, _, won, lost, _ in reports:
        assert won + lost == KEYS
    assert sum(won for _, _, won, _, _ in reports) == KEYS
    assert sum(lost for _, _, _, lost, _ in reports) == (WORKERS - 1) * KEYS

    everything = [p for p in tree.root.rglob("*") if not p.is_dir()]
    assert [p for p in everything if is_temp_name(p.name) or ".tmp." in p.name] == []
    blocks = [p for p in everything if p.name.endswith(BLOCK_SUFFIX)]
    counts = Counter(p.name for p in blocks)
    expected = {f"{key_of(i).hex()}{BLOCK_SUFFIX}" for i in range(KEYS)}
    assert set(counts) == expected
    assert all(n == 1 for n in counts.values())
    assert len(blocks) == KEYS

    for i in range(KEYS):
        path = tree.block_path(NS.id, key_of(i))
        assert tree.contains(NS.id, key_of(i))
        checked = check_block(path)
        geometry, payload = block_of(i)
        assert checked.header.key == key_of(i)
        assert checked.header.geometry == geometry
        assert read_payload(path)[1] == payload
