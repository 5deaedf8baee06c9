"""``PykvSpec``'s metrics as vLLM registers them: every counter and gauge, from the API server's start."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from dashboard import exposition_samples, vllm_registry  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from pykv.connector.compat import OffloadingCounterMetadata, OffloadingGaugeMetadata  # noqa: E402
from pykv.connector.spec import PykvSpec  # noqa: E402
from pykv.counters import Gauge, Metric, prometheus_names  # noqa: E402


def start(extra: dict, engines: tuple[int, ...] = (0,)) -> dict[str, list[tuple[str, float]]]:
    registry, _ = vllm_registry(extra, engines)
    return exposition_samples(generate_latest(registry).decode())


def test_counters_and_per_device_gauges_are_defined_with_their_labels():
    definitions = PykvSpec.build_metric_definitions({})
    assert all(isinstance(definitions[m], OffloadingCounterMetadata) for m in Metric)
    assert all(isinstance(definitions[g], OffloadingGaugeMetadata) for g in Gauge)
    assert definitions[Gauge.DEVICE_INFO].labelnames == ("device", "root")
    assert definitions[Gauge.TREE_BYTES].labelnames == ("device",)
    assert {f"{n}_total" if isinstance(d, OffloadingCounterMetadata) else n
            for n, d in definitions.items()} == prometheus_names()


def test_every_metric_is_exported_from_the_start_with_its_start_value(tmp_path):
    roots = [str(tmp_path / "nvme 0"), str(tmp_path / "nvme1")]
    samples = start({"roots": roots, "max_tree_bytes": "1G"}, engines=(0, 1))
    assert prometheus_names() <= set(samples)
    info = {(labels["engine"], labels["device"]): (labels["root"], value)
            for labels, value in samples[Gauge.DEVICE_INFO]}
    assert info == {(engine, device): (roots[int(device)], 1) for engine in "01" for device in "01"}
    assert [value for _, value in samples["pykv:tree_limit_bytes"]] == [1 << 30] * 4
    assert all(value == 0 for _, value in samples["pykv:evict_behind"])
    assert all(value == 0 for _, value in samples["pykv:load_hits_disk_total"])
    for gauge in (Gauge.TREE_BYTES, Gauge.TREE_BLOCKS, Gauge.EVICT_ROUND_AGE, Gauge.QUARANTINE_FILES):
        assert len(samples[gauge]) == 4 and all(math.isnan(value) for _, value in samples[gauge])


@pytest.mark.parametrize("extra", [{}, {"max_tree_bytes": "1G", "store": False}])
def test_an_engine_that_evicts_nothing_shows_no_limit(tmp_path, extra):
    samples = start({"root": str(tmp_path), **extra})
    assert [value for _, value in samples["pykv:tree_limit_bytes"]] == [0]
    assert math.isnan(samples["pykv:tree_bytes"][0][1])
