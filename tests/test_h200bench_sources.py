"""benchmarks/h200bench/source_report.py and the scripts around it: records name the pykv sources that
ran, the report sets each source's disk and DRAM hits side by side with the ratio to the baseline,
and h200_before_after.sh refuses a snapshot it was not given before any run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from h200bench import source_report
from h200bench.report import build_report, load_records
from h200bench.util import emit

TTFT = {8192: (0.27, 0.08), 81920: (2.3, 0.5)}  # (disk hit, DRAM hit) seconds of the baseline


def write_runs(path: Path, monkeypatch, order: list[str], factor: dict[str, float], jitter: list[float]) -> None:
    """A stage C query engine's records per run of ``order``: each hit at the baseline's TTFT times the
    source's ``factor`` and the run's ``jitter``."""
    for i, source in enumerate(order):
        monkeypatch.setenv("PYKV_H200_SOURCE", source)
        monkeypatch.setenv("PYKV_H200_RUN_ID", f"{source}-{i + 1}")
        monkeypatch.setenv("PYKV_H200_SOURCE_DIGEST", f"digest-{source}")
        for length, (disk, dram) in TTFT.items():
            for phase, ttft in (("query", disk), ("dram", dram)):
                chunks = (length - 1) // 256
                emit(path, {"kind": "ttft", "stage": "C", "label": "pykv-loop-query-header", "system": "pykv",
                            "medium": "loop", "variant": "header", "phase": phase, "length": length, "doc": 0,
                            "ttft": ttft * factor[source] * jitter[i], "cached": chunks * 256,
                            "expected_cached": chunks * 256,
                            "load_blocks_disk" if phase == "query" else "load_blocks_dram": chunks}, echo=False)


def test_every_record_names_the_sources_h200_run_set(tmp_path, monkeypatch):
    monkeypatch.setenv("PYKV_H200_SOURCE", "before")
    monkeypatch.setenv("PYKV_H200_RUN_ID", "before-1")
    monkeypatch.setenv("PYKV_H200_SOURCE_COMMIT", "b9727ea")
    monkeypatch.delenv("PYKV_H200_SOURCE_DIGEST", raising=False)
    rec = emit(tmp_path / "r.jsonl", {"kind": "stage", "stage": "C"}, echo=False)
    assert rec["source"] == "before" and rec["source_run"] == "before-1" and rec["source_commit"] == "b9727ea"
    assert "source_digest" not in rec  # unset variables add nothing
    monkeypatch.delenv("PYKV_H200_SOURCE")
    assert "source" not in emit(tmp_path / "r.jsonl", {"kind": "stage"}, echo=False)


def test_the_sources_table_gives_each_runs_hits_the_medians_and_the_ratio_to_before(tmp_path, monkeypatch):
    results = tmp_path / "results.jsonl"
    write_runs(results, monkeypatch, ["after", "before", "after", "before"], {"before": 1.0, "after": 1.2},
               [1.0, 1.0, 1.02, 1.02])
    s = source_report.build(load_records([str(results)]))
    loop = s.summary["loop"]
    disk = loop[81920]["query"]
    assert list(disk["median"]) == ["before", "after"]  # before is the baseline, though after ran first
    assert abs(disk["ratio"]["after"] - 1.2) < 1e-9 and abs(disk["noise"] - 0.02) < 1e-9
    assert abs(loop[8192]["dram"]["median"]["before"] - 0.08 * 1.01) < 1e-9
    text = "\n".join(s.text)
    assert "after/before" in text and "slower beyond noise" in text and not s.warnings
    assert "Sources side by side" in build_report(load_records([str(results)]))[0]


def test_hits_within_the_runs_spread_are_within_noise_and_one_source_makes_no_section(tmp_path, monkeypatch):
    results = tmp_path / "results.jsonl"
    write_runs(results, monkeypatch, ["before", "after", "before", "after"], {"before": 1.0, "after": 1.03},
               [1.0, 1.0, 1.1, 1.1])
    s = source_report.build(load_records([str(results)]))
    assert {v["query"]["noise"] is not None for v in s.summary["loop"].values()} == {True}
    assert "beyond noise" not in "\n".join(s.text) and "within noise" in "\n".join(s.text)
    only = tmp_path / "one.jsonl"
    write_runs(only, monkeypatch, ["before", "before"], {"before": 1.0}, [1.0, 1.0])
    assert source_report.build(load_records([str(only)])) is None
    assert source_report.build(load_records([str(only)]), always=True) is not None


def test_a_dram_hit_read_from_disk_and_a_digest_that_changed_are_warned(tmp_path, monkeypatch):
    results = tmp_path / "results.jsonl"
    write_runs(results, monkeypatch, ["before", "after"], {"before": 1.0, "after": 1.0}, [1.0, 1.0])
    monkeypatch.setenv("PYKV_H200_SOURCE_DIGEST", "another")
    monkeypatch.setenv("PYKV_H200_RUN_ID", "after-3")
    emit(results, {"kind": "ttft", "system": "pykv", "medium": "loop", "variant": "header", "phase": "dram",
                   "length": 8192, "doc": 0, "ttft": 0.2, "load_blocks_disk": 31, "load_blocks_dram": 0}, echo=False)
    warnings = source_report.build(load_records([str(results)])).warnings
    assert any("different code" in w for w in warnings)
    assert any("DRAM query read 31 blocks from disk" in w for w in warnings)
    assert any("unequally" in w for w in warnings)


def test_before_after_refuses_a_snapshot_it_was_not_given_before_any_run(tmp_path):
    env = {**os.environ, "PYKV_BA_SRC_before": str(tmp_path / "missing"), "PYKV_H200_WORK": str(tmp_path / "w"),
           "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(BENCHMARKS / "h200_before_after.sh"), "before,after"], cwd=BENCHMARKS.parent,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "no " + str(tmp_path / "missing") + "/pykv" in done.stderr
    done = subprocess.run(["bash", str(BENCHMARKS / "h200_before_after.sh"), "before;rm"], cwd=BENCHMARKS.parent,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "bad label" in done.stderr


def test_before_after_runs_a_label_whose_setup_failed_no_more(tmp_path):
    (tmp_path / "snap" / "pykv" / "connector").mkdir(parents=True)
    env = {**os.environ, "PYKV_BA_SRC_before": str(tmp_path / "snap"), "PYKV_H200_WORK": str(tmp_path / "w"),
           "OUT": str(tmp_path / "out"), "PYKV_H200_SITE": str(tmp_path / "no-site"),
           "PYKV_H200_PARTS": str(tmp_path / "no-parts")}
    done = subprocess.run(["bash", str(BENCHMARKS / "h200_before_after.sh"), "before,before"], cwd=BENCHMARKS.parent,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3 and "vllm missing and no parts" in done.stderr  # h200_run.sh cannot install vLLM
    assert "run 1 (before): rc 3" in done.stdout
    assert "run 2/2 (before): skipped, its sources failed" in done.stdout
