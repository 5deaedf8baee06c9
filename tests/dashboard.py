"""The metric names docs/grafana/pykv-dashboard.json queries (its panels' PromQL), for the tests that
prove each is exported (tests/test_dashboard.py against the code, tests/test_serve_e2e.py on /metrics)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "pykv-dashboard.json"

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")  # label matchers (their strings are gone already)
_RANGES = re.compile(r"\[[^\]]*\]")  # range and subquery durations
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                       "group_right", "atan2", "inf", "nan", "start", "end"})


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not a function or aggregation (followed
    by ``(``), a keyword, a label name, a label value, a duration, a number or a Grafana variable."""
    expr = _STRINGS.sub('""', expr)
    expr = _MATCHERS.sub(" ", expr)
    expr = _RANGES.sub(" ", expr)
    expr = _LABEL_LISTS.sub(" ", expr)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        name = match.group()
        if name.lower() in _KEYWORDS or expr[match.end():].lstrip().startswith("("):
            continue
        names.add(name)
    return names


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def panel_exprs(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) of every panel's every target."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield panel.get("title", ""), target["expr"]


def dashboard_metric_names(path: Path = DASHBOARD) -> set[str]:
    """Every metric name the dashboard's panels query."""
    dashboard = json.loads(path.read_text())
    return {name for _, expr in panel_exprs(dashboard) for name in promql_metric_names(expr)}


def vllm_registry(extra_config: dict, engines: tuple[int, ...] = (0,)):
    """(A private Prometheus registry, the metrics object) as vLLM's API server builds them for pykv's
    connector (``build_prom_metrics``: vLLM's ``OffloadPromMetrics`` plus pykv's start values)."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from pykv.connector.connector import PykvOffloadingConnector

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    extra = {"spec_name": "PykvSpec", "spec_module_path": "pykv.connector.spec", **extra_config}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    metrics = PykvOffloadingConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"],
                                                         {index: ["m", str(index)] for index in engines})
    return registry, metrics


def exposition_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition (``/metrics``) as sample name -> [(its labels, its value)]."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        samples.setdefault(name, []).append((dict(_LABEL.findall(labels)), float(value)))
    return samples


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
