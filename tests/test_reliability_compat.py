"""Compatibility: a tree written with one TP size, dtype, block size or layout is never read by an
engine with another (the namespace fingerprint); a file carried across namespaces is refused.

Unit level through ``connector.layout.namespace_for``, then a manager and worker pair on a
tree another configuration wrote. With real engines (another storage block size):
``test_reliability_e2e.py``.
"""

from __future__ import annotations

import itertools
import shutil

import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from pykv.connector.layout import namespace_for  # noqa: E402

from reliability.connector_rig import chunk_keys, connector, offloading_config  # noqa: E402

VARIANTS = {  # what an operator might change between two runs on one tree
    "baseline": {},
    "tp2": {"tp_size": 2},
    "tp4": {"tp_size": 4},
    "dtype-fp16": {"dtype": "float16"},
    "dtype-fp8": {"dtype": "fp8_e4m3"},
    "storage-block-8-blocks": {"blocks_per_chunk": 8},
    "storage-block-2-blocks": {"blocks_per_chunk": 2},
    "engine-block-32-tokens": {"tokens": 32},
    "page-size": {"page": 8192},
    "model": {"model": "other"},
}


def namespace(variant: str, rank: int = 0):
    return namespace_for(offloading_config("/unused", **VARIANTS[variant]), rank=rank)


def test_every_variant_has_its_own_namespace():
    ids = {name: namespace(name).id for name in VARIANTS}
    for a, b in itertools.combinations(VARIANTS, 2):
        assert ids[a] != ids[b], (a, b)


def test_the_same_configuration_always_gives_the_same_namespace():
    assert namespace("baseline") == namespace("baseline")
    assert namespace("tp2", rank=1) == namespace("tp2", rank=1)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_tp_rank_has_its_own_namespace_and_none_is_tp1s(tp):
    config = offloading_config("/unused", tp_size=tp)
    ranks = {namespace_for(config, rank=r).id for r in range(tp)}
    assert len(ranks) == tp and namespace("baseline").id not in ranks


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in ("baseline", "page-size")])
def test_an_engine_with_another_configuration_never_reads_the_tree(tmp_path, variant):
    root = str(tmp_path / "tree")
    writer = connector(root)
    keys = chunk_keys(3, salt=5)
    try:
        writer.store(keys)
        assert all(writer.manager.lookup(k, writer.ctx) is LookupResult.HIT for k in keys)
    finally:
        writer.close()
    reader = connector(root, **VARIANTS[variant])
    try:
        assert reader.manager.namespace.id != writer.manager.namespace.id
        assert all(reader.manager.lookup(k, reader.ctx) is LookupResult.MISS for k in keys)

        # even a file carried by hand into the reader's namespace is refused (header names the writer's)
        source = writer.worker.devices[0].block_path(writer.worker.namespace.id, keys[0])
        target = reader.worker.devices[0].block_path(reader.worker.namespace.id, keys[0])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        failed, report = reader.load([keys[0]], first_block=40)
        assert failed and report.failed_loads == [keys[0]]
        assert reader.worker.counters["load_blocks_failed_disk"] == 1 and reader.worker.counters["quarantined"] == 1
        assert not target.exists() and source.exists()
    finally:
        reader.close()


class _Config:
    """The parts of a ``VllmConfig`` the connector reads for the KV dtype."""

    def __init__(self, cache_dtype, model_dtype) -> None:
        self.cache_config = type("Cache", (), {"cache_dtype": cache_dtype})()
        self.model_config = type("Model", (), {"dtype": model_dtype})()


def test_an_auto_kv_dtype_is_resolved_so_bf16_and_fp16_engines_never_share(monkeypatch):
    """vLLM 26-31 pass ``auto`` in ``OffloadingConfig.model.dtype``; the connector remembers what the
    engine resolves it to (the model's dtype), so the namespace (and fp8's params) name the real dtype."""
    import torch

    from pykv.connector import compat, compat_adapters
    monkeypatch.setattr(compat_adapters, "_engine_kv_dtype", None)
    auto = offloading_config("/unused", dtype="auto")
    assert compat.kv_cache_dtype(auto) == "auto"  # nothing remembered (a unit test's config): as given
    compat.remember_kv_dtype(_Config("auto", torch.bfloat16))
    bf16 = namespace_for(auto, rank=0)
    assert compat.kv_cache_dtype(auto) == "bfloat16" and bf16.dtype == "bfloat16"
    assert bf16 == namespace("baseline")  # the same as a vLLM that resolves it itself (32+)
    compat.remember_kv_dtype(_Config("auto", torch.float16))
    assert namespace_for(auto, rank=0).id != bf16.id
    compat.remember_kv_dtype(_Config("fp8_e4m3", torch.bfloat16))
    assert compat.kv_cache_dtype(auto) == "fp8_e4m3"
    assert compat.kv_cache_dtype(offloading_config("/unused", dtype="float16")) == "float16"  # given: kept
