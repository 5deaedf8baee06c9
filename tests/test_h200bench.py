"""The H200 benchmark's CPU-side parts (benchmarks/h200bench): the counters an engine records, the
report over committed result files of both counter namings, and the plan of the stages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pykv.counters import CounterFile, WorkerCounter

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RUN1 = BENCHMARKS / "results" / "h200-2026-11-29-run1.jsonl"
sys.path.insert(0, str(BENCHMARKS))

from h200bench.engine import counter_fields  # noqa: E402
from h200bench.report import build_report, load_records  # noqa: E402
from h200bench.stats import load_gb_per_s, load_job_fields, read_stats  # noqa: E402

OLD_TO_NEW = {"bench_load_jobs": WorkerCounter.LOAD_JOBS, "bench_load_bytes": WorkerCounter.LOAD_JOB_BYTES,
              "bench_load_us": WorkerCounter.LOAD_JOB_US}


def test_a_ttft_record_takes_load_bandwidth_from_the_workers_own_load_job_counters(tmp_path):
    base = str(tmp_path / "stats" / "engine")
    (tmp_path / "stats").mkdir()
    files = [CounterFile(f"worker{rank}", base=base) for rank in (0, 1)]
    for f in files:
        f.write({WorkerCounter.LOAD_JOBS: 1, WorkerCounter.LOAD_JOB_BYTES: 100, WorkerCounter.LOAD_JOB_US: 10})
    before = read_stats(base)
    files[0].write({WorkerCounter.LOAD_JOBS: 2, WorkerCounter.LOAD_JOB_BYTES: 100 + 3_000_000_000,
                    WorkerCounter.LOAD_JOB_US: 10 + 1_000_000, WorkerCounter.LOAD_BLOCKS_DISK: 7})
    fields = counter_fields(before, read_stats(base))
    assert fields["load_job_bytes"] == 3_000_000_000 and fields["load_job_us"] == 1_000_000
    assert fields["load_jobs"] == 1 and fields["load_blocks_disk"] == 7
    assert fields["load_seconds"] == 1.0 and fields["load_gb_per_s"] == 3.0
    assert fields["worker_delta"] == {"load_blocks_disk": 7, "load_job_bytes": 3_000_000_000, "load_job_us": 1_000_000,
                                      "load_jobs": 1}


def test_a_record_without_load_jobs_has_no_bandwidth():
    fields = counter_fields({"worker0": {"load_blocks_dram": 1}}, {"worker0": {"load_blocks_dram": 3}})
    assert "load_gb_per_s" not in fields and fields["load_blocks_dram"] == 2


def test_load_job_fields_read_both_namings():
    old = {"bench_load_jobs": 2, "bench_load_bytes": 4_000_000_000, "bench_load_us": 2_000_000}
    new = {str(OLD_TO_NEW[k]): v for k, v in old.items()}
    assert load_job_fields(old) == load_job_fields(new) == (2, 4_000_000_000, 2_000_000)
    assert load_gb_per_s(old) == load_gb_per_s(new) == 2.0
    assert load_gb_per_s({"load_gb_per_s": 1.5, **new}) == 1.5  # as recorded
    assert load_gb_per_s({"ttft": 1.0}) is None


def test_the_report_of_run_1_shows_its_load_bandwidths():
    text, md, summary = build_report(load_records([str(RUN1)]))
    virtio = summary["media"]["virtio"]["lengths"]
    assert round(virtio[8192]["load_gb_per_s"], 2) == 1.86  # docs/benchmarks.md, run 1
    assert "L=8,192: disk-hit load 1.86 GB/s" in text and "| 8,192 |" in md


def test_the_report_is_the_same_when_records_carry_only_todays_counter_names(tmp_path):
    renamed = tmp_path / "renamed.jsonl"
    with open(renamed, "w") as out:
        for line in RUN1.read_text().splitlines():
            record = json.loads(line)
            if "bench_load_bytes" in record:
                for old, new in OLD_TO_NEW.items():
                    record[str(new)] = record.pop(old)
                record.pop("load_gb_per_s", None)
            out.write(json.dumps(record) + "\n")
    assert "bench_load_bytes" in RUN1.read_text()
    assert build_report(load_records([str(renamed)]))[0] == build_report(load_records([str(RUN1)]))[0]


@pytest.mark.parametrize("script, stages", [("h200_connector.py", "all"), ("h200_preload.py", "P40,R")])
def test_the_dry_run_plans_stock_pykvspec_engines(tmp_path, script, stages):
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), "stage", stages, "--dry-run",
                             "--work", str(tmp_path / "work"), "--mount-base", str(tmp_path / "mnt"),
                             "--shm", str(tmp_path / "shm")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert '"spec_name": "PykvSpec", "spec_module_path": "pykv.connector.spec"' in result.stdout
    assert "BenchPykvSpec" not in result.stdout
    assert f"ext4 on {tmp_path / 'mnt'}/pykv-h200-" in result.stdout
    assert f"image {tmp_path / 'shm'}/pykv-h200-" in result.stdout


def test_compare_passes_a_calibration_against_itself_and_flags_run_6_against_run_7():
    from h200bench.compare import compare
    results = BENCHMARKS / "results"
    run6, run7 = str(results / "calibration-h200-8b-loop-run6.json"), str(results / "calibration-h200-8b-loop-run7.json")
    lines, ok = compare(run7, run7, 0.05)
    assert ok and len(lines) == 1 + 2 * 2 * 6  # header; 2 tiers x 6 lengths x (hit, recompute)
    lines, ok = compare(run6, run7, 0.05)
    assert not ok
    assert any(line.startswith("disk   65,536 hit_s") and line.endswith("OUT") for line in lines)  # 2.476 -> 2.032 s
    assert all(not line.endswith("OUT") for line in lines if "recompute_s" in line)
