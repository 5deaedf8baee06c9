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
        assert f.flush()
    before = read_stats(base)
    files[0].write({WorkerCounter.LOAD_JOBS: 2, WorkerCounter.LOAD_JOB_BYTES: 100 + 3_000_000_000,
                    WorkerCounter.LOAD_JOB_US: 10 + 1_000_000, WorkerCounter.LOAD_BLOCKS_DISK: 7})
    assert files[0].flush()
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
    assert round(virtio[8192]["load_gb_per_s"], 2) == 1.86  # run 1: benchmarks/results/history/06-connector-h200-runs-1-5.md
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


@pytest.mark.parametrize("script, stages", [("h200_connector.py", "all"), ("h200_preload.py", "P40,R"),
                                            ("h200_decode.py", "I")])
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


# -- issue 17's stages S1-S3 (benchmarks/h200bench/striping*.py, multibw.py, interfaces.py) ------------------
def test_the_dry_run_plans_the_striped_stages_with_what_pykv_config_prints(tmp_path):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "h200_connector.py"), "stage", "S1,S2,S3", "--dry-run",
                             "--work", str(tmp_path / "work"), "--mount-base", str(tmp_path / "mnt"),
                             "--shm", str(tmp_path / "shm")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    configs = [json.loads(line.split("kv_transfer_config: ", 1)[1]) for line in result.stdout.splitlines()
               if "kv_transfer_config: " in line]
    pykv = [c["kv_connector_extra_config"] for c in configs if c["kv_connector"] == "PykvOffloadingConnector"]
    striped = [c for c in pykv if "roots" in c]
    assert len(striped) == 2 and all(len(c["roots"]) == 8 for c in striped)  # fill and query engine
    assert [c["root"] for c in pykv if "root" in c] == [f"{tmp_path / 'mnt'}/pykv-h200-stripe0/pykv-stripe1"] * 4
    for c in pykv:  # pykv's defaults, DRAM tier off
        assert c["staging_bytes"] == "auto" and c["dram_bytes"] == 0 and c["verify"] == "full"
    threads = [c["kv_connector_extra_config"]["secondary_tiers"][0]["n_read_threads"] for c in configs
               if c["kv_connector"] == "OffloadingConnector"]
    assert threads == [16, 4, 16, 64, 4]  # fill, then one query engine per setting and the first again
    assert "calibrate 3b over 8 roots" in result.stdout
    assert result.stdout.count(f"image {tmp_path / 'shm'}/pykv-h200-stripe7.img") == 3  # made (or reused) per stage


def stripe_records() -> list[dict]:
    """What S1-S3 record, with round numbers: 8 devices read 24 GB/s together, one 5 GB/s."""
    recs = []
    for n, gb in ((1, 5.0), (8, 24.0)):
        recs += [{"kind": "bw", "what": "odirect_read_agg", "medium": f"stripe{n}", "devices": n, "block": b,
                  "depth": d, "gb_per_s": gb * f} for (b, d), f in (((4 << 20, 16), 1.0), ((28 << 20, 8), 0.9))]

    def engine(label, system, medium, variant, ttft, start, load=None):
        out = [{"kind": "engine", "label": label, "system": system, "medium": medium, "variant": variant,
                "start_s": 30, "ts": start}]
        for i, (length, t) in enumerate(ttft.items()):
            out.append({"kind": "ttft", "label": label, "system": system, "medium": medium, "variant": variant,
                        "phase": "query", "length": length, "doc": 0, "ttft": t, "cached": length - 256,
                        "expected_cached": length - 256, "ts": start + 1 + i,
                        **({"load_gb_per_s": load[length]} if load else {})})
        return out

    recs += engine("pykv-stripe8-query", "pykv", "stripe8", "defaults", {32768: 0.24, 81920: 0.65}, 100,
                   {32768: 21.0, 81920: 19.0})
    recs += engine("pykv-stripe1-query", "pykv", "stripe1", "defaults", {32768: 0.90, 81920: 1.80}, 200)
    recs += engine("pykv-stripe1-query-again", "pykv", "stripe1", "defaults", {32768: 0.70, 81920: 1.90}, 300)
    recs += engine("native-fs-stripe1-threads4", "native_fs", "stripe1", "threads4", {32768: 1.2, 81920: 2.4}, 400)
    recs += engine("native-fs-stripe1-threads16", "native_fs", "stripe1", "threads16", {32768: 1.0, 81920: 2.5}, 500)
    recs.append({"kind": "calibration", "medium": "stripe8", "file": "calibration-3b-stripe8.json",
                 "break_even": {"disk": 8000.0}, "read_gb_per_s": 22.0, "ts": 600,
                 "gate_check": {"tolerance": 1.05, "max_ratio": 1.08, "all_ok": False, "all_right": True,
                                "points": [{"tokens": 1024, "ratio": 1.08, "ok": False, "right": True},
                                           {"tokens": 81920, "ratio": 1.0, "ok": True, "right": True}]}})
    return recs


def test_the_report_checks_issue_17s_targets_against_the_best_aggregate_and_the_best_native_setting():
    text, md, summary = build_report(stripe_records())
    s = summary["striping"]
    assert s["odirect_reference"] == {1: 5.0, 8: 24.0}  # the better of 4 MiB x 16 and 28 MiB x 8
    at80 = s["lengths"][81920]
    assert at80["native_best"] == 2.4 and at80["pykv"][1] == 1.85  # both one-device engines pooled
    assert at80["load_vs_odirect"][8] == 19.0 / 24.0
    for line in ("L=32,768: load path on 8 devices 21.00 GB/s = 88% of aggregate O_DIRECT 24.00 GB/s "
                 "(target >= 85%): PASS",
                 "L=81,920: load path on 8 devices 19.00 GB/s = 79% of aggregate O_DIRECT 24.00 GB/s "
                 "(target >= 85%): FAIL",
                 "L=32,768: disk hit on 8 devices 0.240 s (target <= 0.25 s): PASS",
                 "L=81,920: disk hit on 8 devices 0.650 s (target <= 0.6 s): FAIL",
                 "L=32,768: native fs on one device (best, 1.000 s) / pykv on 8 devices = 4.17x (target >= 4x): PASS",
                 "L=81,920: native fs on one device (best, 2.400 s) / pykv on 8 devices = 3.69x (target >= 4x): FAIL",
                 "L=32,768: one device, native fs best 1.000 s / pykv defaults 0.800 s = 1.25x (target >= 1.2x): PASS",
                 "L=81,920: one device, native fs best 2.400 s / pykv defaults 1.850 s = 1.30x (target >= 1.2x): PASS",
                 "gated sweep: max 1.08x the better path (target <= 1.05x at every length): FAIL; outside: "
                 "1,024 (1.08x); right path everywhere: True"):
        assert line in text and line in md
    assert "break-even disk 8,000 tokens" in text


def test_stage_s4_compares_authenticated_hits_with_verify_full_and_keeps_them_out_of_issue_17s_table():
    recs = stripe_records()
    for variant, ttft in (("defaults", {32768: 0.80, 81920: 2.00}), ("auth", {32768: 0.82, 81920: 2.12}),
                          ("auth-1t", {32768: 0.80, 81920: 2.06})):
        for length, t in ttft.items():
            recs.append({"kind": "ttft", "stage": "S4", "label": f"pykv-stripe1-{variant}-query", "system": "pykv",
                         "medium": "stripe1", "variant": variant, "phase": "query", "length": length, "doc": 0,
                         "ttft": t, "cached": length - 256, "expected_cached": length - 256, "ts": 700,
                         "load_blocks_disk": length // 256 - 1, "load_blocks_failed_disk": 0,
                         "load_job_bytes": length * 100_000, "load_job_us": int(t * 1e6)})
    text, md, summary = build_report(recs)
    assert "not a clean disk hit" not in text
    assert "load jobs, GB/s per query: verify=full 4.10, auth_key_file 4.00, auth_key_file, mac_threads=1 4.10" \
        in text  # 32k: 3.28 GB / 0.80 s, / 0.82 s
    assert "L=81,920: verify=full 2.000 s, auth_key_file, mac_threads=1 2.060 s = 1.030x (target <= 1.05x): PASS" in md
    assert "L=32,768: verify=full 0.800 s, auth_key_file 0.820 s = 1.025x" in text
    assert "L=81,920: verify=full 2.000 s, auth_key_file 2.120 s = 1.060x (target <= 1.05x): FAIL" in md
    assert summary["striping"]["lengths"][81920]["pykv"][1] != 2.12  # the auth engine is not pooled with the defaults


def test_the_dry_run_of_stage_s4_alternates_defaults_and_two_keyed_variants_on_one_device(tmp_path):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "h200_connector.py"), "stage", "S4", "--dry-run",
                             "--work", str(tmp_path / "work"), "--mount-base", str(tmp_path / "mnt"),
                             "--shm", str(tmp_path / "shm")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    engines = [line.split()[1].rstrip(":") for line in result.stdout.splitlines() if line.startswith("  engine ")]
    once = ["pykv-stripe1-fill", "pykv-stripe1-query", "pykv-stripe1-auth-fill", "pykv-stripe1-auth-query",
            "pykv-stripe1-auth-1t-fill", "pykv-stripe1-auth-1t-query"]
    assert engines == once + [engine + "-again" for engine in once]
    configs = [json.loads(line.split("kv_transfer_config: ", 1)[1])["kv_connector_extra_config"]
               for line in result.stdout.splitlines() if "kv_transfer_config: " in line]
    assert [("auth_key_file" in c, c.get("mac_threads"), c["verify"]) for c in configs] == \
        [(False, 0, "full")] * 2 + [(True, 0, "full")] * 2 + [(True, 1, "full")] * 2 + \
        [(False, 0, "full")] * 2 + [(True, 0, "full")] * 2 + [(True, 1, "full")] * 2


def test_the_dry_run_of_stage_s5_fills_once_and_loads_the_tree_with_each_load_variant(tmp_path):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "h200_connector.py"), "stage", "S5", "--dry-run",
                             "--work", str(tmp_path / "work"), "--mount-base", str(tmp_path / "mnt"),
                             "--shm", str(tmp_path / "shm")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "verify=full with 8 hashing threads, at depth 4/8/16" in result.stdout
    engines = [line.split()[1].rstrip(":") for line in result.stdout.splitlines() if line.startswith("  engine ")]
    assert engines == ["pykv-stripe8-fill", "pykv-stripe8-query", "pykv-stripe8-depth4-query",
                       "pykv-stripe8-repeat-query", "pykv-stripe8-depth8-query", "pykv-stripe8-threadpool-query", "pykv-stripe8-header-query",
                       "pykv-stripe8-vt4-query"]
    configs = [json.loads(line.split("kv_transfer_config: ", 1)[1])["kv_connector_extra_config"]
               for line in result.stdout.splitlines() if "kv_transfer_config: " in line]
    assert [(c["verify"], c["verify_threads"], c["io_engine"], c["io_depth"], len(c["roots"])) for c in configs] == \
        [("full", "auto", "auto", 16, 8), ("full", "auto", "auto", 16, 8), ("full", "auto", "auto", 4, 8),
         ("full", "auto", "auto", 16, 8), ("full", "auto", "auto", 8, 8), ("full", "auto", "threadpool", 16, 8),
         ("header", "auto", "auto", 16, 8), ("full", 4, "auto", 16, 8)]


def test_stage_s5_reports_each_query_variant_with_its_load_rate():
    recs = stripe_records()
    for variant, ttft in (("defaults", 0.71), ("vt4", 0.67), ("header", 0.674)):
        for doc in (0, 1):
            recs.append({"kind": "ttft", "stage": "S5", "label": f"pykv-stripe8-{variant}-query", "system": "pykv",
                         "medium": "stripe8", "variant": variant, "phase": "query", "length": 81920, "doc": doc,
                         "ttft": ttft + doc * 0.01, "load_job_bytes": 9_000_000_000, "load_job_us": 600_000 + doc})
    text, md, summary = build_report(recs)
    line = ("L=81,920: defaults 0.715 s (load 15.00-15.00 (n=2) GB/s), vt4 0.675 s (load 15.00-15.00 (n=2) GB/s), "
            "header 0.679 s (load 15.00-15.00 (n=2) GB/s)")
    assert line in text and line in md and summary["verify"]["lines"] == [line]


def test_the_report_without_striped_records_has_no_issue_17_section():
    text, _, summary = build_report(load_records([str(RUN1)]))
    assert "Issue 17" not in text and "striping" not in summary


def direct_dirs(tmp_path, n):
    from pykv.io.probe import direct_io_supported
    dirs = [tmp_path / f"dev{i}" for i in range(n)]
    for d in dirs:
        d.mkdir()
    if not direct_io_supported(str(dirs[0]))[0]:
        pytest.skip("no O_DIRECT here")
    return dirs


def test_aggregate_reads_move_every_devices_bytes_and_report_each_device(tmp_path):
    from h200bench.multibw import together
    paths = [d / "f.dat" for d in direct_dirs(tmp_path, 3)]
    size = 8 << 20
    wrote = together(paths, "write", engine="threadpool", size=size, block=1 << 20, depth=2)
    assert wrote["bytes"] == 3 * size and all(p.stat().st_size == size for p in paths)
    read = together(paths, "read", engine="threadpool", size=size, block=1 << 20, depth=4)
    assert read["bytes"] == 3 * size and len(read["per_device_gb_per_s"]) == 3


def test_a_device_that_fails_stops_the_pass_instead_of_leaving_the_others_waiting(tmp_path):
    from h200bench.multibw import together
    dirs = direct_dirs(tmp_path, 2)
    good = dirs[0] / "f.dat"
    together([good], "write", engine="threadpool", size=4 << 20, block=1 << 20, depth=2)
    with pytest.raises(FileNotFoundError):
        together([good, dirs[1] / "missing.dat"], "read", engine="threadpool", size=4 << 20, block=1 << 20, depth=2)


def test_the_reactor_pass_loads_block_files_over_every_device_in_each_mode_and_leaves_nothing(tmp_path, monkeypatch):
    """``mbw``'s reactor pass: header, full and authenticated loads of real block files over the set,
    one record each; the throwaway key and the trees are gone afterwards."""
    import argparse
    import tempfile

    from h200bench.multibw import FILE_BLOCK, FILES_WHAT, reactor_files
    dirs = direct_dirs(tmp_path, 2)
    keys = tmp_path / "keys"
    keys.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(keys))
    results = tmp_path / "r.jsonl"
    reactor_files(argparse.Namespace(results=str(results), stage="S1", files_size=2 * FILE_BLOCK, files_depth=2,
                                     files_modes="header,full,auth", verify_threads=""), dirs, ["threadpool"])
    records = [json.loads(line) for line in results.read_text().splitlines()]
    reads = {r["verify"]: r for r in records if r["what"] == FILES_WHAT}
    assert sorted(reads) == ["auth", "full", "header"]
    assert all(r["bytes"] >= 2 * FILE_BLOCK * len(dirs) - FILE_BLOCK and r["gb_per_s"] > 0 for r in reads.values())
    assert list(keys.iterdir()) == [] and all(list(d.iterdir()) == [] for d in dirs)


def test_the_reactor_pass_hashes_once_per_thread_count_and_reports_each(tmp_path):
    """S5's pass: ``verify=header`` once, ``verify=full`` per ``--verify-threads`` count, tagged with it."""
    import argparse

    from h200bench.multibw import FILE_BLOCK, FILES_WHAT, reactor_files
    dirs = direct_dirs(tmp_path, 2)
    results = tmp_path / "r.jsonl"
    reactor_files(argparse.Namespace(results=str(results), stage="S5", files_size=FILE_BLOCK, files_depth=2,
                                     files_modes="header,full", verify_threads="2,3"), dirs, ["threadpool"])
    records = [json.loads(line) for line in results.read_text().splitlines()]
    reads = sorted((r["verify"], r.get("verify_threads", 0)) for r in records if r["what"] == FILES_WHAT)
    assert reads == [("full", 2), ("full", 3), ("header", 0)]
    assert all(r["gb_per_s"] > 0 for r in records)
    text, _, _ = build_report(records)
    assert "verify=full, 3 hashing threads" in text and "verify=header:" in text


def test_the_report_shows_the_reactor_pass_beside_the_aggregate():
    recs = stripe_records() + [{"kind": "bw", "what": "files_read_agg", "medium": "stripe8", "devices": 8,
                                "engine": "pykv reactor threadpool", "verify": mode, "gb_per_s": gb}
                               for mode, gb in (("full", 18.0), ("auth", 12.0), ("full", 20.4))]
    text, _, _ = build_report(recs)
    assert "8 devices, pykv reactor threadpool, verify=full: 20.40 GB/s = 85% of O_DIRECT" in text
    assert "8 devices, pykv reactor threadpool, verify=auth: 12.00 GB/s = 50% of O_DIRECT" in text


def test_the_host_copy_probe_moves_every_threads_bytes_and_the_report_keeps_the_best_per_thread_count():
    from h200bench.multibw import COPY_WHAT, host_copy
    out = host_copy(2, size=8 << 20, reps=2)
    assert out["threads"] == 2 and out["bytes"] == 2 * (8 << 20) * 2 and out["gb_per_s"] > 0
    recs = stripe_records() + [{"kind": "bw", "what": COPY_WHAT, "threads": n, "gb_per_s": gb}
                               for n, gb in ((1, 11.0), (8, 25.5), (8, 26.25))]
    text, _, _ = build_report(recs)
    assert "1 threads: 11.00 GB/s copied" in text and "8 threads: 26.25 GB/s copied" in text
    assert "host memory copy bandwidth" in build_report(stripe_records())[0]  # "not measured" without the probe


def test_the_calibration_over_several_roots_is_the_calibrate_job_s_own_run(tmp_path):
    from h200bench.interfaces import calibration_over
    from pykv.jobs.calibrate_plan import CalibrationRun
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    run = calibration_over(CalibrationRun, roots, model="m", lengths=[1024])
    assert run.root_paths == roots


class ConfigRunner:
    """What ``interfaces.pykv_config`` uses of the stage runner."""

    def __init__(self, tmp_path):
        import argparse
        self.a = argparse.Namespace(pykv_set=None, io_engine="auto")
        self.dry, self.stage, self.work = False, "S1", tmp_path
        self.records = []

    def record(self, rec):
        self.records.append(rec)


@pytest.mark.parametrize("printed_roots, source", [(["/d0/t", "/d1/t"], "command"), (["/d1/t"], "library")])
def test_the_striped_config_is_what_pykv_config_prints_unless_it_names_other_roots(tmp_path, monkeypatch,
                                                                                  printed_roots, source):
    from h200bench import interfaces
    roots = ["/d0/t", "/d1/t"]
    printed = interfaces.library_ktc(printed_roots, [])
    monkeypatch.setattr(interfaces, "command_ktc", lambda runner, r, items, dram_zero=False: (printed, ""))
    runner = ConfigRunner(tmp_path)
    ktc = interfaces.pykv_config(runner, roots, medium="stripe2")
    assert interfaces.config_roots(ktc) == roots
    assert ktc["kv_connector_extra_config"]["dram_bytes"] == 0
    (rec,) = runner.records
    assert rec["source"] == source and rec["ktc"] == ktc
    assert ("command_error" in rec) == (source == "library")


@pytest.mark.parametrize("io_engine, pykv_set, expected", [
    ("auto", None, "auto"), ("threadpool", None, "threadpool"),
    ("threadpool", ["io_engine=io_uring"], "io_uring")])
def test_the_stripe_stages_take_io_engine_into_the_config(tmp_path, io_engine, pykv_set, expected):
    # run 10 passed --io-engine threadpool to S1 and it silently measured the default
    from h200bench import interfaces
    runner = ConfigRunner(tmp_path)
    runner.a.io_engine, runner.a.pykv_set = io_engine, pykv_set
    ktc = interfaces.library_ktc(["/d0/t"], interfaces.set_items(runner))
    assert ktc["kv_connector_extra_config"]["io_engine"] == expected


def test_s5_runs_the_query_variants_asked_for_and_refuses_unknown_ones():
    from h200bench.verify_stage import QUERIES, chosen_queries
    assert chosen_queries("") == QUERIES
    assert chosen_queries("header, defaults") == [QUERIES[0], QUERIES[5]]  # in QUERIES' order
    with pytest.raises(SystemExit, match="unknown variant.*bogus"):
        chosen_queries("defaults,bogus")


def test_engines_named_in_pykv_pyspy_run_under_py_spy_and_others_as_they_are(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from h200bench import runner as runner_module
    runner = SimpleNamespace(results=tmp_path / "work" / "results.jsonl", out=tmp_path)
    argv = ["python3", "h200_connector.py", "engine", "cfg.json"]
    monkeypatch.setattr(runner_module.shutil, "which", lambda name: "/deps/bin/py-spy" if name == "py-spy" else None)
    monkeypatch.delenv("PYKV_PYSPY", raising=False)
    assert runner_module.Runner.profiled(runner, "pykv-stripe8-query", argv) == argv
    monkeypatch.setenv("PYKV_PYSPY", "query")
    assert runner_module.Runner.profiled(runner, "pykv-stripe8-fill", argv) == argv
    wrapped = runner_module.Runner.profiled(runner, "pykv-stripe8-query", argv)
    assert wrapped[:2] == ["/deps/bin/py-spy", "record"] and "--gil" in wrapped and "--subprocesses" in wrapped
    assert wrapped[wrapped.index("--output") + 1] == str(tmp_path / "pyspy-pykv-stripe8-query.json")
    assert wrapped[wrapped.index("--") + 1:] == argv
    monkeypatch.setenv("PYKV_PYSPY_ARGS", "--idle --native")
    wrapped = runner_module.Runner.profiled(runner, "pykv-stripe8-query", argv)
    assert "--gil" not in wrapped and wrapped[3:5] == ["--idle", "--native"]
    monkeypatch.setattr(runner_module.shutil, "which", lambda name: None)  # no py-spy on the host
    assert runner_module.Runner.profiled(runner, "pykv-stripe8-query", argv) == argv


def test_the_striping_notes_give_each_engines_staging_on_huge_pages():
    recs = stripe_records()
    for r in recs:
        if r.get("kind") == "ttft" and r["label"] == "pykv-stripe8-query":
            r.update(staging_bytes=8 << 30, staging_huge_bytes=6 << 30)
    text, _, _ = build_report(recs)
    assert "pykv-stripe8-query: 32,768 0.240 s, 81,920 0.650 s, staging 8.0 GiB, 75% on huge pages" in text
    assert "pykv-stripe1-query: 32,768 0.900 s, 81,920 1.800 s\n" in text + "\n"  # no gauges: no staging note


def test_a_ttft_record_carries_the_staging_gauges_as_values():
    before = {"worker0": {"staging_bytes": 100, "staging_huge_bytes": 40, "load_jobs": 1}}
    after = {"worker0": {"staging_bytes": 100, "staging_huge_bytes": 40, "load_jobs": 2}}
    fields = counter_fields(before, after)
    assert fields["staging_bytes"] == 100 and fields["staging_huge_bytes"] == 40


def test_the_report_splits_a_disk_hits_time_by_pykvs_counters():
    recs = stripe_records()
    for r in recs:
        if r.get("kind") == "ttft" and r["label"] == "pykv-stripe8-query":
            r.update(load_job_us=int(r["ttft"] * 1e6) - 60_000, scheduler_delta={"survey_us": 12_000},
                     worker_delta={"load_report_wait_us": 3_000})
    text, _, _ = build_report(recs)
    assert "L=32,768: TTFT 240 ms = survey 12.0 + load job 180 + report wait 3.0 + the rest 45 (n=1)" in text
    assert "L=81,920: TTFT 650 ms = survey 12.0 + load job 590 + report wait 3.0 + the rest 45 (n=1)" in text


def test_the_gated_sweep_line_gives_the_gates_own_cost_when_recorded():
    recs = stripe_records()
    cal = next(r for r in recs if r.get("kind") == "calibration")
    cal["gate_check"]["points"][0].update(gate_s=40e-6, gate_share=0.002)
    cal["gate_check"]["points"][1].update(gate_s=60e-6, gate_share=0.0001)
    text, _, _ = build_report(recs)
    assert "the gate's own cost: at most 60 us, 0.20% of the better path (at 1,024 tokens)" in text
    assert "the gate's own cost" not in build_report(stripe_records())[0]


def test_the_gated_sweep_gives_both_baselines_per_length_when_recorded():
    recs = stripe_records()
    cal = next(r for r in recs if r.get("kind") == "calibration")
    cal["gate_check"]["points"][0].update(ratio_engines=1.48)
    cal["gate_check"]["points"][1].update(ratio_engines=1.12)
    text, _, _ = build_report(recs)
    assert ("gated sweep per length (better path measured in the gated engine / in the recompute and disk "
            "engines): 1,024 1.08/1.48, 81,920 1.00/1.12") in text
    assert "gated sweep per length" not in build_report(stripe_records())[0]


def test_the_time_split_adds_the_copiers_side_and_the_devices_when_recorded():
    recs = stripe_records()
    for r in recs:
        if r.get("kind") == "ttft" and r["label"] == "pykv-stripe8-query":
            r.update(load_job_us=500_000, worker_delta={"h2d_batches": 100, "h2d_issue_us": 350_000,
                                                        "h2d_build_us": 60_000, "h2d_op_us": 190_000,
                                                        "h2d_queued_us": 200_000},
                     disks={"loop0": {"read_bytes": 3_000_000_000, "busy_ms": 500, "read_ms": 9000},
                            "loop1": {"read_bytes": 1_000_000_000, "busy_ms": 250, "read_ms": 3000}})
    text, _, _ = build_report(recs)
    assert "the copier: 100 batches, issuing 350 ms (build 60, op 190; queued for its thread 200)" in text
    assert "the devices: busy 50%-100% of the load job, bytes 0.50-1.50x the mean per device, " \
           "4.00-6.00 GB/s per device while busy" in text
    assert "the copier:" not in build_report(stripe_records())[0]  # records without the counters


def test_diskstats_gives_each_devices_reads_and_busy_time_between_snapshots(tmp_path):
    from h200bench import diskstats
    before = {"loop0": [10, 0, 100, 5, 0, 0, 0, 0, 0, 40, 50], "loop1": [1] * 11}
    after = {"loop0": [20, 0, 300, 9, 0, 0, 0, 0, 0, 70, 90], "loop1": [1] * 11, "loop2": [2] * 11}
    assert diskstats.delta(before, after) == {
        "loop0": {"read_bytes": 200 * 512, "busy_ms": 30, "read_ms": 4},
        "loop1": {"read_bytes": 0, "busy_ms": 0, "read_ms": 0}}  # loop2: no "before", left out
    assert diskstats.delta({"loop0": [1, 2]}, {"loop0": [1, 2]}) == {}  # a short line: left out
    paths = diskstats.stat_paths([str(tmp_path), str(tmp_path / "missing")])
    assert all(p.endswith("/stat") for p in paths.values()) and len(paths) <= 1
    snap = diskstats.snapshot(paths)
    assert all(len(v) > diskstats.IO_TICKS for v in snap.values())


def test_stage_s5_sets_each_engines_first_load_of_a_length_beside_its_second():
    from h200bench.verify_stage import block_order_lines
    recs = []
    for variant, first, second in (("defaults", 0.60, 0.65), ("repeat", 0.61, 0.60)):
        for ttft, entries in ((first, 10_560), (second, 141_680 if variant == "defaults" else 10_560)):
            recs.append({"kind": "ttft", "stage": "S5", "label": f"pykv-stripe8-{variant}-query", "system": "pykv",
                         "variant": variant, "phase": "query", "length": 81920, "ttft": ttft,
                         "worker_delta": {"delivered_blocks": 320, "h2d_entries": entries}})
    recs.append({**recs[0], "length": 8192, "worker_delta": {}})  # no copier counters: left out
    assert block_order_lines(recs, ["defaults", "repeat"]) == [
        "L=81,920: defaults 0.600 s (33) / 0.650 s (443), repeat 0.610 s (33) / 0.600 s (33)"]


def test_a_ttft_record_places_its_loads_steps_inside_the_request():
    from h200bench.engine import timeline
    t0 = 1_000_000_000_000
    before = {"scheduler": {"survey_began_ns": t0 - 5_000_000}, "worker0": {"load_ended_ns": t0 - 1}}
    after = {"scheduler": {"survey_began_ns": t0 + 2_000_000, "survey_ended_ns": t0 + 14_000_000,
                           "load_planned_ns": t0 + 15_000_000, "surveys": 3},
             "worker0": {"load_submitted_ns": t0 + 20_000_000, "load_ended_ns": t0 + 540_000_000,
                         "load_reported_ns": t0 + 541_000_000, "load_jobs": 2},
             "worker1": {"load_ended_ns": t0 + 545_000_000}}
    window = (t0, t0 + 620_000_000)
    assert timeline(after, window) == {"survey_began": 2.0, "survey_ended": 14.0, "load_planned": 15.0,
                                       "load_submitted": 20.0, "load_ended": 545.0, "load_reported": 541.0,
                                       "first_token": 620.0}  # a worker step: the latest rank's
    assert timeline(before, window) == {}  # earlier requests' steps: none of this one's
    fields = counter_fields(before, after, window=window)
    assert fields["timeline"]["load_ended"] == 545.0
    assert not any(k.endswith("_ns") for k in fields["worker_delta"]) and "surveys" in fields["scheduler_delta"]
    assert not any(k.endswith("_ns") for k in fields["scheduler_delta"])
    recs = stripe_records()
    for r in recs:
        if r.get("kind") == "ttft" and r["label"] == "pykv-stripe8-query":
            r.update(load_job_us=500_000, timeline=fields["timeline"])
    assert "the steps, ms from the request: survey began 2.0, ended 14.0, load planned 15.0, at the worker " \
           "20.0, loaded 545.0, collected 541.0, first token 620.0" in build_report(recs)[0]


@pytest.mark.parametrize("mode", ["ceiling-h2d", "ceiling-hash", "ceiling-hash-h2d"])
def test_the_ceiling_pass_hashes_and_copies_every_block_it_reads_once(tmp_path, monkeypatch, mode):
    """``mbw``'s ceiling engines: each block read passes through the mode's hash and GPU copy
    (faked here: a CPU target, events that are done at once) before its slot is read into again."""
    import contextlib

    import torch
    import xxhash

    from h200bench import ceiling
    from h200bench.multibw import together
    paths = [d / "f.dat" for d in direct_dirs(tmp_path, 2)]
    block, blocks = 1 << 20, 6
    together(paths, "write", engine="threadpool", size=blocks * block, block=block, depth=2)
    hashed, copied = [], []
    real_hash, real_empty = xxhash.xxh3_64_intdigest, torch.empty
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", lambda data: hashed.append(real_hash(data)))
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))

    class Event:
        def record(self, stream):
            copied.append(stream)

        def query(self):
            return True
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(ceiling, "page_lock", lambda address, length: None)
    monkeypatch.setattr(ceiling, "page_unlock", lambda address: None)
    try:
        got = ceiling.ceiling_pass(paths, mode, size=blocks * block, block=block, depth=2)
    except OSError as exc:  # io_uring refused here
        pytest.skip(f"io_uring: {exc}")
    hash_slots, h2d = ceiling.MODES[mode]
    assert got["bytes"] == 2 * blocks * block and len(got["per_device_gb_per_s"]) == 2
    assert len(hashed) == (2 * blocks if hash_slots else 0)
    assert len(copied) == (2 * blocks if h2d else 0)


def test_the_s1_report_lists_each_engines_loads_in_order_with_document_and_entries():
    from h200bench.striping_report import load_order_lines
    rows = []
    for doc, ttft, entries in ((0, 2.244, 10_560), (0, 2.687, 141_680), (1, 2.6, 141_680)):
        rows.append({"label": "pykv-stripe1-query", "length": 81920, "doc": doc, "ttft": ttft,
                     "load_job_us": 2_000_000, "disks": {"loop0": {"busy_ms": 1980}},
                     "worker_delta": {"delivered_blocks": 320, "h2d_entries": entries}})
    rows.append({"label": "pykv-stripe1-query", "length": 8192, "doc": 0, "ttft": 0.3, "worker_delta": {}})  # no load
    assert load_order_lines(rows) == ["pykv-stripe1-query L=81,920: doc 0 2.244 s (33, busiest 99%) / "
                                      "doc 0 2.687 s (443, busiest 99%) / doc 1 2.600 s (443, busiest 99%)"]


def test_s1_stripe_variants_parse_names_and_keys_and_refuse_a_bare_name():
    from h200bench.striping import stripe_variants
    assert stripe_variants(["fp8:codec=fp8", "z:codec=planes-zstd;codec_decode=gpu"]) == [
        ("fp8", {"codec": "fp8"}), ("z", {"codec": "planes-zstd", "codec_decode": "gpu"})]
    assert stripe_variants(["big:codec=fp8;block_size=512"]) == [("big", {"codec": "fp8", "block_size": 512})]
    with pytest.raises(SystemExit, match="NAME:KEY=VALUE"):
        stripe_variants(["fp8"])


def test_s1_stripe_queries_may_add_no_keys_but_need_a_name():
    from h200bench.striping import stripe_variants
    assert stripe_variants(["n:", "w:idle_wait_ms=2"], option="--stripe-query", empty=True) == [
        ("n", {}), ("w", {"idle_wait_ms": 2})]
    with pytest.raises(SystemExit, match="--stripe-query"):
        stripe_variants([":idle_wait_ms=2"], option="--stripe-query", empty=True)
