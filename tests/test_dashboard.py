"""docs/grafana/pykv-dashboard.json: a Grafana dashboard whose every queried metric pykv exports.

Against the names the code builds (``prometheus_names``) and against vLLM's own Prometheus
registry as its API server builds it for pykv; tests/test_serve_e2e.py finds them on a real
server's ``/metrics``.
"""

from __future__ import annotations

import json

import pytest
from dashboard import DASHBOARD, dashboard_metric_names, exposition_samples, panel_exprs, panels, promql_metric_names

from pykv.counters import prometheus_names

#: What the dashboard must show (issue 35): hits, load failures, stores, eviction, the tree per device, quarantine.
COVERED = {"pykv:load_hits_disk_total", "pykv:load_hits_dram_total", "pykv:load_failures_total",
           "pykv:stored_blocks_total", "pykv:store_failures_total", "pykv:stores_over_limit_total",
           "pykv:evict_rounds_total", "pykv:evicted_bytes_total", "pykv:evict_errors_total", "pykv:evict_behind",
           "pykv:evict_round_age_seconds", "pykv:tree_bytes", "pykv:tree_limit_bytes", "pykv:tree_blocks",
           "pykv:quarantine_bytes", "pykv:quarantine_files", "pykv:device_info"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_it_is_a_grafana_dashboard_on_a_prometheus_datasource_variable(dashboard):
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    [source] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    chosen = {"type": "prometheus", "uid": f"${{{source['name']}}}"}
    shown = [p for p in panels(dashboard) if p["type"] != "row"]
    assert shown and all(p["datasource"] == chosen for p in shown)
    assert all(t["datasource"] == chosen and t["expr"] for p in shown for t in p["targets"])
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == chosen
            selector = variable["definition"].removeprefix("label_values(").rsplit(",", 1)[0]  # (metric, label)
            assert promql_metric_names(selector) and promql_metric_names(selector) <= prometheus_names()


def test_every_panel_queries_metrics_pykv_exports(dashboard):
    for title, expr in panel_exprs(dashboard):
        names = promql_metric_names(expr)
        assert names, (title, expr)
        assert names <= prometheus_names(), (title, names - prometheus_names())
    assert COVERED <= dashboard_metric_names()


def test_the_metric_names_are_read_from_promql_as_prometheus_would():
    expr = ('max by (instance, device, root) ((pykv:tree_bytes{a=~"$x", b="c(d)"} > 0) * ignoring(root) '
            'group_left(root) pykv:device_info) / on(job) group_left sum(rate(x_total[$__rate_interval] offset 5m)) '
            '> bool 1e9 and time() - y')
    assert promql_metric_names(expr) == {"pykv:tree_bytes", "pykv:device_info", "x_total", "y"}


def test_every_dashboard_metric_is_in_vllms_registry_from_the_start(tmp_path):
    pytest.importorskip("vllm")
    from prometheus_client import generate_latest

    from dashboard import vllm_registry
    registry, _ = vllm_registry({"roots": [str(tmp_path / "a"), str(tmp_path / "b")], "max_tree_bytes": "1G"})
    samples = exposition_samples(generate_latest(registry).decode())
    assert dashboard_metric_names() <= set(samples)
    assert prometheus_names() <= set(samples)
