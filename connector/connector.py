"""``PykvOffloadingConnector``: vLLM's ``OffloadingConnector`` plus pykv's failure channel.

Load it with ``kv_connector="PykvOffloadingConnector"``,
``kv_connector_module_path="pykv.connector.connector"`` (``PykvConfig.to_kv_transfer_config``
writes the whole dict). Stock ``OffloadingConnector`` has no failure path (it
asserts every transfer succeeded); this subclass adds one:

- worker side: ``get_block_ids_with_load_errors`` drains the GPU blocks of failed
  loads from ``PykvWorker`` (vLLM recomputes from the first bad block); models with
  several KV groups (where 0.31+ refuse block-level errors) report the request in
  ``failed_recving`` instead (0.30+). ``build_connector_worker_meta`` piggybacks
  the worker's ``WorkerReport`` (failed keys, store failures) on vLLM's metadata.
- scheduler side: ``update_connector_output`` hands that report to ``PykvManager``
  before vLLM completes the jobs of the same step, so failed keys are forgotten
  before the request is looked up again.

It refuses to start unless ``kv_load_failure_policy`` is ``"recompute"``: with
vLLM's default ``"fail"`` a corrupt cache file would fail the user's request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pykv.errors import InputError

from pykv.connector import compat
from pykv.connector.compat import OffloadingConnector, OffloadingWorkerMetadata
from pykv.connector.spec import WorkerReport


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
        if kv_cache_config is None:
            super().__init__(vllm_config, role, **kwargs)
        else:
            super().__init__(vllm_config, role, kv_cache_config, **kwargs)
        self._failed_load_requests: set[str] = set()

    # -- worker side ---------------------------------------------------------------------------
    @property
    def _pykv_worker(self) -> Any:
        worker = getattr(self.connector_worker, "worker", None) if self.connector_worker else None
        return worker if hasattr(worker, "take_report") else None

    def _request_level_failures(self) -> bool:
        worker = self._pykv_worker
        return compat.HAS_TRANSFER_RESULTS and worker is not None and len(worker.layout.groups) > 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        load_jobs = dict(getattr(self.connector_worker, "_load_jobs", {}) or {})
        sending, recving = super().get_finished(finished_req_ids)
        worker = self._pykv_worker
        if worker is not None and self._request_level_failures():
            for job_id in worker.take_failed_load_jobs():
                if job_id in load_jobs:
                    self._failed_load_requests.add(load_jobs[job_id])
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self._failed_load_requests:
            failed, self._failed_load_requests = self._failed_load_requests, set()
            results = compat.transfer_results(set(results.finished_sending), set(results.finished_recving),
                                              set(getattr(results, "failed_recving", ()) or ()) | failed)
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
    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, PykvWorkerMetadata) and meta.report and self.connector_scheduler is not None:
            manager = self.connector_scheduler.manager
            if hasattr(manager, "on_worker_report"):
                manager.on_worker_report(meta.report)
        super().update_connector_output(connector_output)
