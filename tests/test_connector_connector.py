"""PykvOffloadingConnector pieces that need no engine: the start check, the metadata channel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from pykv.errors import InputError  # noqa: E402

from pykv.connector.compat import OffloadingWorkerMetadata  # noqa: E402
from pykv.connector.connector import PykvOffloadingConnector, PykvWorkerMetadata  # noqa: E402
from pykv.connector.spec import WorkerReport  # noqa: E402


@pytest.mark.parametrize("policy", ["fail", None])
def test_refuses_to_start_without_recompute_policy(policy):
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy) if policy else None)
    with pytest.raises(InputError, match="kv_load_failure_policy: pykv needs \"recompute\""):
        PykvOffloadingConnector(config, role=None, kv_cache_config=None)


def report(loads=(), stores=(), error=None) -> WorkerReport:
    r = WorkerReport()
    r.failed_loads, r.failed_stores, r.store_error = list(loads), list(stores), error
    return r


def test_worker_metadata_carries_reports_through_aggregation():
    first = OffloadingWorkerMetadata()
    first.mark_completed(7)
    a = PykvWorkerMetadata.wrap(first, report(loads=[b"k1"]))
    b = PykvWorkerMetadata.wrap(None, report(stores=[(b"k2", True)], error="write: No space left on device"))
    b.mark_completed(7)
    merged = a.aggregate(b)
    assert isinstance(merged, PykvWorkerMetadata)
    assert merged.completed_jobs == {7: 2}
    assert merged.report.failed_loads == [b"k1"] and merged.report.failed_stores == [(b"k2", True)]
    assert merged.report.store_error.startswith("write:")
    plain = OffloadingWorkerMetadata()  # another worker with nothing to report
    assert a.aggregate(plain).report.failed_loads == [b"k1"]


def test_empty_report_is_falsy():
    assert not WorkerReport() and report(loads=[b"x"])
