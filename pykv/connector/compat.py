"""Every difference between the vLLM versions pykv supports (0.26 to 0.33), in one place.

The rest of pykv imports vLLM names and version adapters from here, never from vLLM or the
modules below directly, so a new vLLM release means reading this table and editing the modules
this one re-exports: ``compat_names`` (the vLLM names pykv uses, and which of the version-dependent
ones this vLLM has), ``compat_metrics`` (stats, gauges and Prometheus metrics through vLLM) and
``compat_adapters`` (everything else: configs, connector and engine internals, hashing).

| difference                              | versions  | absorbed by                    |
|-----------------------------------------|-----------|--------------------------------|
| ``OffloadingEvent.medium`` str vs enum  | 26 / 27+  | ``STORAGE_MEDIUM``             |
| ``OffloadPolicy`` default member name   | 26-29/30+ | ``DEFAULT_OFFLOAD_POLICY``     |
| ``block_ids`` int64 vs int32            | 26-29/30+ | ``block_ids()`` (always int64) |
| ``submit_load(..., expedited=)``        | 33        | worker: ahead of regular loads |
| sync loads (``sync_load_budget_bytes``) | 33        | refused: ``sync_load_budget()``|
|   (``_load_jobs`` holds None for them)  |           | ``load_job_requests()``        |
| ``OffloadingManager.on_reset_flushed``  | 33 / 26-32| 32-: ``ResetFence`` backport   |
| ``get_load_source`` (hit's tier)        | 32, 33    | manager answers HOST / DISK    |
| ``config_info`` / ``config_info_keys``  | 33        | spec + manager fill them       |
| block errors with >1 KV cache group     | 31+       | ``kv_cache_group_count()``:    |
|   (``RuntimeError``; vLLM counts ALL)   |           | request-level reports instead  |
| ``OffloadingManager.lock``              | 33        | base default (no-op) is right: |
|                                         |           | our manager has no thread      |
| ``get_transfer_results``/failed_recving | 30+       | ``HAS_TRANSFER_RESULTS``       |
| ``kv_cache_layout`` in OffloadingConfig | 29+       | ``kv_layout()``                |
| ``model.dtype`` ``auto`` passed on     | 26-31     | ``kv_cache_dtype()`` resolves  |
|   (OffloadingConfig)                    |           | it (``remember_kv_dtype``)     |
| cross-layer HND blocks on CUDA          | 26-28     | ``kv_layout()`` names it       |
| ``group_idx`` meaning (index vs id)     | 26-29/30+ | opaque: part of the key bytes  |
| private attributes pykv must read       | 26-33     | ``load_job_requests``,         |
|   (``_load_jobs``, ``_kv_cache_config``,|           | ``kv_cache_group_count``,      |
|   ``_connector_metadata``, ``_jobs``)   |           | ``bound_metadata``,            |
|                                         |           | ``in_flight_jobs``             |
| the connector's worker and manager      | 26-33     | ``connector_offloading_worker``|
|   (``connector_worker.worker``,         |           | ``connector_offloading_manager``|
|   ``connector_scheduler.manager``)      |           | ``scheduler_offloading_manager``|
| offload keys (last hash of each chunk,  | 26-33     | ``make_offload_key``,          |
|   ``update_offload_keys``)              |           | ``prompt_block_hasher``; used  |
|                                         |           | by ``offload_keys.py``         |
| Prometheus gauges of a spec             | 32, probed| ``gauge_definition``,          |
|   (``OffloadingGaugeMetadata``,         |           | ``set_gauge``: None / no-op    |
|   ``OffloadingConnectorStats.set_gauge``)|          | where missing (no gauges)      |
| binding a spec metric at start          | 32, probed| ``bind_offload_metric``: None  |
|   (``OffloadPromMetrics.                |           | where missing (the metric      |
|   _get_prometheus_metric``, private)    |           | appears once first reported)   |
| ``LLM``, ``SamplingParams``,            | 26-33     | lazy module attributes here    |
|   ``current_platform``, in-process      |           | (``compat.LLM`` ...),          |
|   engine (``llm_engine``)               |           | ``engine_vllm_config``,        |
|                                         |           | ``step_engine``, ``device_name``|
"""

from __future__ import annotations

from typing import Any

from pykv.connector.compat_adapters import (  # noqa: F401  (re-exported)
    batched_copy_op,
    block_ids,
    bound_metadata,
    cache_hit_source,
    completed_jobs,
    connector_offloading_manager,
    connector_offloading_worker,
    connector_worker_meta,
    current_vllm_config,
    default_none_hash_seed,
    device_name,
    engine_args_parser,
    engine_vllm_config,
    extra_config,
    failed_recving,
    group_ids,
    hash_fn_by_name,
    in_flight_jobs,
    is_cpu_platform,
    kv_cache_dtype,
    kv_cache_group_count,
    kv_layout,
    load_failure_policy,
    load_job_requests,
    platform_name,
    prompt_block_hasher,
    remember_kv_dtype,
    route_logs,
    scheduler_group_configs,
    scheduler_offloading_manager,
    shutdown_engine,
    skips_prefix_cache,
    step_engine,
    sync_load_budget,
    transfer_results,
)
from pykv.connector.compat_metrics import (  # noqa: F401  (re-exported)
    bind_offload_metric,
    gauge_definition,
    new_stats,
    set_gauge,
)
from pykv.connector.compat_names import (  # noqa: F401  (re-exported)
    DEFAULT_OFFLOAD_POLICY,
    HAS_OFFLOAD_GAUGES,
    HAS_RESET_FLUSHED,
    HAS_TRANSFER_RESULTS,
    STORAGE_MEDIUM,
    SYNC_LOAD_KEY,
    VLLM_MINOR,
    VLLM_VERSION,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    KVConnectorBase_V1,
    KVConnectorTransferResults,
    LoadStoreSpec,
    LookupResult,
    OffloadingConfig,
    OffloadingConnector,
    OffloadingConnectorMetadata,
    OffloadingConnectorStats,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadingWorkerMetadata,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    make_offload_key,
)


def __getattr__(name: str) -> Any:
    """vLLM's offline API (``LLM``, ``SamplingParams``) and ``current_platform``, imported on first
    use: same names in 0.26 to 0.33, and too heavy to import with every connector process."""
    if name in ("LLM", "SamplingParams"):
        import vllm as api
        return getattr(api, name)
    if name == "current_platform":
        from vllm.platforms import current_platform
        return current_platform
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
