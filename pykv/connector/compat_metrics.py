"""pykv's stats, gauges and Prometheus metrics through vLLM's offload metrics route, where this vLLM has it.

Re-exported by ``pykv.connector.compat``, which the rest of pykv imports instead. The version
table (spec gauges, binding a spec metric at start) is in ``compat``'s docstring.
"""

from __future__ import annotations

from typing import Any

from pykv.connector.compat_names import (
    HAS_OFFLOAD_GAUGES,
    OffloadingConnectorStats,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)


def new_stats() -> OffloadingConnectorStats:
    return OffloadingConnectorStats()


def gauge_definition(documentation: str, labelnames: tuple[str, ...]) -> OffloadingMetricMetadata | None:
    """A spec's gauge for ``build_metric_definitions``, or None where this vLLM exports no spec gauges."""
    if not HAS_OFFLOAD_GAUGES:
        return None
    return OffloadingGaugeMetadata(documentation=documentation, labelnames=labelnames)


def set_gauge(stats: OffloadingConnectorStats, name: str, value: float, labels: tuple[str, ...]) -> None:
    """Report a gauge's value in ``stats`` (the latest wins); nothing where this vLLM has no spec gauges."""
    if HAS_OFFLOAD_GAUGES:
        stats.set_gauge(name, value, labels)


def bind_offload_metric(prom_metrics: Any, name: str, labels: tuple[str, ...], engine_idx: int) -> Any:
    """The Prometheus child of spec metric ``name`` for one engine and label values, bound now (a
    labelled metric is absent from ``/metrics`` until bound); None where ``OffloadPromMetrics`` has no
    per-metric registry (``_get_prometheus_metric``) or registered the metric otherwise."""
    bind = getattr(prom_metrics, "_get_prometheus_metric", None)
    if bind is None:
        return None
    try:
        return bind(name, labels, engine_idx)
    except (KeyError, AssertionError):
        return None
