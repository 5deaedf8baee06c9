"""``PykvOffloadingConnector``: vLLM's ``OffloadingConnector`` plus pykv's failure channel.

Load it with ``kv_connector="PykvOffloadingConnector"``,
``kv_connector_module_path="pykv.connector.connector"`` (``PykvConfig.to_kv_transfer_config``
writes the whole dict). Stock ``OffloadingConnector`` has no failure path (it
asserts every transfer succeeded); this subclass adds one:

- worker side: ``get_block_ids_with_load_errors`` drains the GPU blocks of failed
  loads from ``PykvWorker`` (vLLM recomputes from the first bad block); models with
  several KV cache groups (where 0.31+ raise ``RuntimeError`` on block-level errors,
  counting every group of the model, offloaded or not) report the request in
  ``failed_recving`` instead (0.30+), which makes vLLM recompute it from token 0.
  ``build_connector_worker_meta`` piggybacks the worker's ``WorkerReport`` (failed
  keys, store failures) on vLLM's metadata.
- scheduler side: ``update_connector_output`` hands that report to ``PykvManager``
  before vLLM completes the jobs of the same step, so failed keys are forgotten
  before the request is looked up again.
  ``get_num_new_matched_tokens`` first hands the manager the request's block keys
  (built as vLLM builds them), so its block index finds them at once and, with a
  break-even gate, refuses a load below the threshold before vLLM's chunk-by-chunk
  lookups run.

Preloading (scheduler-aware, on stock vLLM): ``on_new_request`` hands each
request's block keys (built as vLLM builds them) to ``PykvManager`` while the
request enters the waiting queue; ``build_connector_meta`` attaches the manager's
preload plan (req_id -> keys to read ahead, and requests to drop) to vLLM's
metadata as ``PykvConnectorMetadata``; on the worker, ``start_load_kv`` first lets
vLLM submit this step's loads (which claim blocks already preloaded) and then
hands the drops and new preloads to ``PykvWorker``.

Cache resets: vLLM 0.33 tells the manager (``on_reset_flushed``) when the workers
have finished every job in flight at ``reset_cache``; on older vLLM this connector
does it (``ResetFence``), so DRAM slots those jobs use are never handed out early.

It refuses to start unless ``kv_load_failure_policy`` is ``"recompute"``: with
vLLM's default ``"fail"`` a corrupt cache file would fail the user's request. It
also refuses ``sync_load_budget_bytes`` (vLLM 0.33's synchronous loads): 0.33 can
only fail a load of a request still waiting for it, so a failed sync load would
leave the request running on blocks that were never filled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pykv.errors import InputError
from pykv.preload import PreloadPlan

from pykv.connector import compat, offload_keys
from pykv.connector.compat import OffloadingConnector, OffloadingConnectorMetadata, OffloadingWorkerMetadata
from pykv.connector.manager import PykvManager
from pykv.connector.spec import WorkerReport
from pykv.connector.worker import PykvWorker


@dataclass
class PykvWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata plus a ``WorkerReport`` (merged across workers)."""

    report: WorkerReport = field(default_factory=WorkerReport)

    @classmethod
    def wrap(cls, base: OffloadingWorkerMetadata | None, report: WorkerReport) -> "PykvWorkerMetadata":
        values = {} if base is None else {f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                                          if f.name != "report"}
        return cls(**values, report=report)

    def aggregate(self, other: Any) -> "PykvWorkerMetadata":
        merged = super().aggregate(other)
        return PykvWorkerMetadata.wrap(merged, self.report.merge(getattr(other, "report", None)))


@dataclass
class PykvConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's scheduler -> worker metadata plus preload instructions and the step's kind.

    ``preloads``: req_id -> block keys to read ahead for that waiting request.
    ``released``: requests whose preloads the worker may drop.
    ``idle``: the step schedules no tokens (the workers run no model; ``idle_wait_ms``).
    """

    preloads: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    released: tuple[str, ...] = ()
    idle: bool = False

    @classmethod
    def wrap(cls, base: OffloadingConnectorMetadata, preloads: dict[str, tuple[bytes, ...]],
             released: tuple[str, ...], idle: bool = False) -> "PykvConnectorMetadata":
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)
                  if f.name not in ("preloads", "released", "idle")}
        return cls(**values, preloads=dict(preloads), released=tuple(released), idle=idle)


class ResetFence:
    """Jobs in flight at a cache reset whose worker reports are still due (vLLM before 0.33,
    which does this itself and calls ``on_reset_flushed``): job id -> reports due."""

    def __init__(self) -> None:
        self.due: dict[int, int] = {}

    def add(self, jobs: dict[int, int]) -> None:
        for job_id, count in jobs.items():
            self.due[job_id] = self.due.get(job_id, 0) + count

    def reported(self, completed: dict[int, int]) -> bool:
        """Count these completions; True when this emptied the fence."""
        if not self.due:
            return False
        for job_id, count in completed.items():
            if job_id in self.due:
                self.due[job_id] -= count
                if self.due[job_id] <= 0:
                    del self.due[job_id]
        return not self.due


def refuse_sync_loads(vllm_config: Any) -> None:
    budget = compat.sync_load_budget(vllm_config)
    if budget not in (0, "0"):
        raise InputError(
            f"kv_connector_extra_config.{compat.SYNC_LOAD_KEY}: pykv does not take synchronous loads yet "
            f"(got {budget!r}); remove the key: vLLM cannot recompute a failed synchronous load, so a "
            "damaged cache file would leave the request running on KV that was never loaded.")


class PykvOffloadingConnector(OffloadingConnector):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, **kwargs: Any) -> None:
        policy = compat.load_failure_policy(vllm_config)
        if policy != "recompute":
            raise InputError(
                f"kv_transfer_config.kv_load_failure_policy: pykv needs \"recompute\", got {policy!r}. "
                "Set it in --kv-transfer-config (e.g. '{\"kv_load_failure_policy\": \"recompute\", ...}'; "
                "`pykv config` prints a complete one) so that a damaged or vanished cache file makes vLLM "
                "recompute those tokens instead of failing the request.")
        refuse_sync_loads(vllm_config)
        compat.remember_kv_dtype(vllm_config)  # before vLLM builds the spec: namespaces and codecs read it
        self._reset_fence = ResetFence()
        if kv_cache_config is None:
            super().__init__(vllm_config, role, **kwargs)
        else:
            super().__init__(vllm_config, role, kv_cache_config, **kwargs)
        self._failed_load_requests: set[str] = set()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        """vLLM's metrics, with every ``pykv:*`` metric exported from the start (``export_at_start``)."""
        from pykv.connector.spec import export_at_start
        metrics = super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        export_at_start(metrics, per_engine_labelvalues, compat.extra_config(vllm_config))
        return metrics

    # -- worker side ---------------------------------------------------------------------------
    @property
    def _pykv_worker(self) -> PykvWorker | None:
        """The worker side's ``PykvWorker`` (None on the scheduler, or under another spec's worker)."""
        worker = compat.connector_offloading_worker(self)
        return worker if isinstance(worker, PykvWorker) else None

    def _request_level_failures(self) -> bool:
        """Whether failed loads go to vLLM as requests (``failed_recving``), not blocks: when vLLM's
        scheduler would refuse block errors, i.e. when the MODEL has several KV cache groups (vLLM
        counts them all, whether pykv offloads them or not)."""
        worker = self._pykv_worker
        if not compat.HAS_TRANSFER_RESULTS or worker is None:
            return False
        groups = compat.kv_cache_group_count(self)
        return (groups if groups is not None else len(worker.layout.groups)) > 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        meta = compat.bound_metadata(self)
        worker = self._pykv_worker
        if worker is not None and isinstance(meta, PykvConnectorMetadata) and meta.idle:
            worker.wait_idle_step()
        load_jobs = compat.load_job_requests(self.connector_worker) if self.connector_worker else {}
        sending, recving = super().get_finished(finished_req_ids)
        if worker is not None and self._request_level_failures():
            for job_id in worker.take_failed_load_jobs():
                req_id = load_jobs.get(job_id)
                if req_id is not None:  # None: a sync load (refused at start, so never here)
                    self._failed_load_requests.add(req_id)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self._failed_load_requests:
            failed, self._failed_load_requests = self._failed_load_requests, set()
            results = compat.transfer_results(set(results.finished_sending), set(results.finished_recving),
                                              compat.failed_recving(results) | failed)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._pykv_worker
        if worker is None:
            return set()
        failed = worker.get_block_ids_with_load_errors()
        return set() if self._request_level_failures() else failed

    def build_connector_worker_meta(self) -> Any:
        meta = super().build_connector_worker_meta()
        worker = self._pykv_worker
        if worker is None:
            return meta
        report = worker.take_report()
        if meta is None and not report:
            return None
        # Always our subclass: vLLM aggregates workers into the first one's object.
        return PykvWorkerMetadata.wrap(meta, report)

    # -- scheduler side ------------------------------------------------------------------------
    @property
    def _pykv_manager(self) -> PykvManager | None:
        """The scheduler side's ``PykvManager`` (None on a worker, or under another spec's manager)."""
        manager = compat.connector_offloading_manager(self)
        return manager if isinstance(manager, PykvManager) else None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any) -> Any:
        manager = self._pykv_manager
        if manager is not None:  # the request's blocks at once (and the break-even gate) first
            groups = [(g.tokens_per_chunk, keys) for g, keys in self._keys_per_group(request)]
            manager.survey_request(request.request_id, groups, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs)

    # -- preloading: scheduler side ------------------------------------------------------------------
    def _preload_manager(self) -> PykvManager | None:
        manager = self._pykv_manager
        return manager if manager is not None and manager.preloads is not None else None

    def _keys_per_group(self, request: Any) -> list[tuple[Any, list[bytes]]]:
        """(group config, the request's offload keys in that group) as vLLM builds them
        (``offload_keys.chunk_offload_keys``): one key per full chunk."""
        return [(g, offload_keys.chunk_offload_keys(request.block_hashes, g.hashes_per_chunk, g.group_idx))
                for g in compat.scheduler_group_configs(self.connector_scheduler)]

    def request_block_keys(self, request: Any) -> list[bytes]:
        """The request's offload keys chunk by chunk; with several KV groups, chunk i of every
        group before chunk i + 1."""
        return offload_keys.chunk_major([keys for _, keys in self._keys_per_group(request)])

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        manager = self._preload_manager()
        if manager is not None and not compat.skips_prefix_cache(request):
            manager.preload_candidate(request.request_id, self.request_block_keys(request))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if not isinstance(meta, OffloadingConnectorMetadata):
            return meta
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0
        manager = self._preload_manager()
        plan = manager.take_preload_plan() if manager is not None else PreloadPlan()
        if not plan and not idle:
            return meta
        return PykvConnectorMetadata.wrap(meta, plan.preloads, plan.released, idle)

    # -- preloading: worker side ------------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)  # this step's loads claim what is preloaded
        meta = compat.bound_metadata(self)
        worker = self._pykv_worker
        if isinstance(meta, PykvConnectorMetadata) and worker is not None:
            worker.release_preloads(meta.released)
            worker.submit_preloads(meta.preloads)

    # -- scheduler side: worker feedback -------------------------------------------------------------
    def update_connector_output(self, connector_output: Any) -> None:
        meta = compat.connector_worker_meta(connector_output)
        manager = self._pykv_manager
        if isinstance(meta, PykvWorkerMetadata) and meta.report and manager is not None:
            manager.on_worker_report(meta.report)
        super().update_connector_output(connector_output)
        if self._reset_fence.reported(compat.completed_jobs(meta)) and manager is not None:
            manager.on_reset_flushed()

    def shutdown(self) -> None:
        """vLLM's shutdown, then the manager's (its evictor thread) where this vLLM's scheduler side
        does not forward it; the manager's is idempotent."""
        super().shutdown()
        manager = self._pykv_manager
        if manager is not None:
            manager.shutdown()

    def reset_cache(self) -> Any:
        """(Before 0.33) fence the jobs in flight: the manager learns when they are all reported."""
        if compat.HAS_RESET_FLUSHED or self.connector_scheduler is None:
            return super().reset_cache()
        in_flight = compat.in_flight_jobs(self.connector_scheduler)
        result = super().reset_cache()
        self._reset_fence.add(in_flight)
        manager = self._pykv_manager
        if not self._reset_fence.due and manager is not None:
            manager.on_reset_flushed()
        return result
