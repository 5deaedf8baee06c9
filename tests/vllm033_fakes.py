"""Faithful fakes of vLLM 0.33's side of pykv's contract (0.33 cannot run here).

Each is the 0.33 source cut down to what pykv meets, with the file it comes from:

- ``ConnectorWorker033``: ``offloading/worker.py`` ``OffloadingConnectorWorker``:
  ``start_kv_transfers`` (a sync load maps its job to None in ``_load_jobs``, is
  submitted ``expedited=True`` and waited on in the same step) and ``get_finished``
  (``assert transfer_result.success``; ``_load_jobs.pop`` -> ``finished_recving``).
- ``Scheduler033``: ``v1/core/sched/scheduler.py``: ``_handle_failed_recving`` (only a
  request still ``WAITING_FOR_REMOTE_KVS`` can fail) and ``_handle_invalid_blocks``
  (``RuntimeError`` when the model has more than one KV cache group, counting all).
- ``ResetFence033``: ``offloading/scheduler.py`` ``_reset_cache`` and
  ``_update_connector_output``: ``manager.reset_cache()``, then ``on_reset_flushed()``
  once every worker reported every job in flight at the reset (at once if none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from pykv.connector.compat import OffloadingWorkerMetadata

WAITING_FOR_REMOTE_KVS, RUNNING = "waiting_for_remote_kvs", "running"


@dataclass
class LoadJob:
    """0.33's ``TransferJob`` of a load (``sync`` is new in 0.33)."""

    req_id: str
    src_spec: object
    dst_spec: object
    sync: bool = False


class ConnectorWorker033:
    def __init__(self, worker) -> None:
        self.worker = worker
        self._load_jobs: dict[int, str | None] = {}  # job_id -> req_id for in-flight loads (None for sync loads)
        self._connector_worker_meta = OffloadingWorkerMetadata()

    def start_kv_transfers(self, load_jobs: dict[int, LoadJob]) -> None:
        sync_job_ids: set[int] = set()
        for job_id, entry in load_jobs.items():
            if entry.sync:
                sync_job_ids.add(job_id)
                self._load_jobs[job_id] = None
                success = self.worker.submit_load(job_id, entry.src_spec, entry.dst_spec, expedited=True)
            else:
                self._load_jobs[job_id] = entry.req_id
                success = self.worker.submit_load(job_id, entry.src_spec, entry.dst_spec)
            assert success
        if sync_job_ids:
            self.worker.wait(sync_job_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        finished_recving: set[str] = set()
        for transfer_result in self.worker.get_finished():
            job_id = transfer_result.job_id
            assert transfer_result.success
            self._connector_worker_meta.mark_completed(job_id)
            req_id = self._load_jobs.pop(job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)
        return set(), finished_recving

    def build_connector_worker_meta(self):
        if not self._connector_worker_meta.completed_jobs:
            return None
        meta, self._connector_worker_meta = self._connector_worker_meta, OffloadingWorkerMetadata()
        return meta


class Scheduler033:
    """The scheduler's handling of one step's ``KVConnectorOutput`` load failures
    (``kv_load_failure_policy="recompute"``)."""

    def __init__(self, num_kv_cache_groups: int, requests: dict[str, str]) -> None:
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[object()] * num_kv_cache_groups)
        self.status = dict(requests)  # req_id -> status
        self.failed_recving_kv_req_ids: set[str] = set()
        self.invalid_blocks_seen: set[int] = set()

    def update_from_output(self, failed_recving: set, invalid_block_ids: set[int]) -> None:
        if failed_recving:
            self._handle_failed_recving(failed_recving)
        if invalid_block_ids:
            self._handle_invalid_blocks(invalid_block_ids)

    def _handle_failed_recving(self, failed_req_ids: set) -> None:
        for req_id in failed_req_ids:
            if self.status.get(req_id) == WAITING_FOR_REMOTE_KVS:
                self.failed_recving_kv_req_ids.add(req_id)  # num_computed_tokens = 0: recompute

    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> None:
        if len(self.kv_cache_config.kv_cache_groups) > 1:
            raise RuntimeError(
                "A KV connector reported block-level load failures (invalid_block_ids) which is not supported "
                "for models with multiple KV cache groups. Connectors must report failed requests via "
                "KVConnectorTransferResults.failed_recving instead.")
        self.invalid_blocks_seen |= invalid_block_ids


@dataclass
class ResetFence033:
    manager: object
    jobs: dict[int, int] = field(default_factory=dict)  # the scheduler's in-flight jobs: id -> pending_count
    _reset_fence: dict[int, int] = field(default_factory=dict)

    def reset_cache(self) -> None:
        self.manager.reset_cache()
        if self.jobs:
            self._reset_fence.update(self.jobs)
        elif not self._reset_fence:
            self.manager.on_reset_flushed()
        self.jobs.clear()

    def completed(self, completed_jobs: dict[int, int]) -> None:
        for job_id, count in completed_jobs.items():
            if job_id in self._reset_fence:
                self._reset_fence[job_id] -= count
                if self._reset_fence[job_id] <= 0:
                    del self._reset_fence[job_id]
                    if not self._reset_fence:
                        self.manager.on_reset_flushed()
