"""Stage T of the H200 benchmark (issue 19, benchmarks/h200bench/tp_stage.py, tp_report.py): the plan
of its engines and the report's TP section (no engine runs here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from h200bench.engine import counter_fields  # noqa: E402
from h200bench.report import build_report  # noqa: E402


def test_the_dry_run_plans_tp2_engines_a_tp1_probe_and_the_native_fs_tier(tmp_path):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "h200_connector.py"), "stage", "T", "--dry-run",
                             "--work", str(tmp_path / "work"), "--mount-base", str(tmp_path / "mnt"),
                             "--shm", str(tmp_path / "shm")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    engines = {line.split()[1].rstrip(":"): line for line in result.stdout.splitlines()
               if line.startswith("  engine ")}
    assert list(engines) == ["tp2-recompute", "tp2-pykv-fill", "tp2-pykv-tp1-probe", "tp2-pykv-query",
                             "tp2-native-fs-fill", "tp2-native-fs-query"]
    assert "'enable_prefix_caching': True, 'tensor_parallel_size': 2" in engines["tp2-recompute"]
    for label in ("tp2-pykv-fill", "tp2-pykv-query", "tp2-native-fs-fill", "tp2-native-fs-query"):
        assert "'tensor_parallel_size': 2" in engines[label]
    assert "tensor_parallel_size" not in engines["tp2-pykv-tp1-probe"]
    assert "model-8b (shape 8b), tensor_parallel_size 2; oracle document 8193 tokens" in result.stdout
    configs = [json.loads(line.split("kv_transfer_config: ", 1)[1]) for line in result.stdout.splitlines()
               if "kv_transfer_config: " in line]
    roots = [c["kv_connector_extra_config"].get("root") for c in configs[:3]]
    assert roots == [f"{tmp_path / 'mnt'}/pykv-h200-tp-pykv/pykv-tree"] * 3  # fill, probe and query share the tree


def test_a_record_keeps_each_ranks_counters_when_there_are_several():
    before = {"worker0": {"load_blocks_disk": 1}, "worker1": {"load_blocks_disk": 1}}
    after = {"worker0": {"load_blocks_disk": 5}, "worker1": {"load_blocks_disk": 6}}
    fields = counter_fields(before, after)
    assert fields["load_blocks_disk"] == 9
    assert [c["load_blocks_disk"] for c in fields["per_rank"].values()] == [4, 5]
    assert "per_rank" not in counter_fields({"worker0": {}}, {"worker0": {"load_blocks_disk": 2}})


def tp_records(*, hit_tokens: list[int], probe_cached: int = 0) -> list[dict]:
    def ttft(label, system, variant, length, t, ts, cached=0, ranks=None):
        rec = {"kind": "ttft", "label": label, "system": system, "medium": "tp2", "variant": variant,
               "phase": "query", "length": length, "doc": 0, "ttft": t, "cached": cached,
               "expected_cached": length - 256, "ts": ts, "load_blocks_disk": 0}
        if ranks:
            rec["per_rank"] = {f"worker{i}": {"load_blocks_disk": n, "load_blocks_failed_disk": 0}
                               for i, n in enumerate(ranks)}
        return rec

    recs = [{"kind": "ttft", "label": "recompute", "system": "recompute", "medium": None, "variant": "",
             "phase": "query", "length": 8192, "doc": 0, "ttft": 0.1, "cached": 0, "expected_cached": 7936, "ts": 1}]
    recs += [ttft("tp2-recompute", "recompute", "prefix-cache", 8192, 0.5, 10),
             ttft("tp2-recompute", "recompute", "prefix-cache", 81920, 2.0, 11),
             {"kind": "tokens", "medium": "tp2", "phase": "oracle", "length": 8193, "run": 1, "cached": 8192,
              "tokens": [5, 6, 7], "ts": 12},
             {"kind": "tp_tree", "medium": "tp2", "when": "fill", "ts": 20, "namespaces": [
                 {"tp_size": 2, "tp_rank": 0, "files": 356}, {"tp_size": 2, "tp_rank": 1, "files": 356}]},
             ttft("tp2-pykv-tp1-probe", "pykv", "tp1-over-tp2", 8192, 0.3, 30, cached=probe_cached),
             ttft("tp2-pykv-query", "pykv", "header", 8192, 0.1, 40, cached=7936, ranks=[31, 31]),
             ttft("tp2-pykv-query", "pykv", "header", 81920, 0.4, 41, cached=81664, ranks=[319, 319]),
             {"kind": "tokens", "medium": "tp2", "phase": "hit", "length": 8193, "run": 0, "cached": 8192,
              "tokens": hit_tokens, "ts": 42, "per_rank": {"worker0": {"load_blocks_disk": 32},
                                                          "worker1": {"load_blocks_disk": 32}}},
             {"kind": "tokens", "medium": "tp2", "phase": "tp1-only", "length": 8192, "run": 0, "cached": 0, "ts": 43},
             ttft("tp2-native-fs-query", "native_fs", "threads16", 8192, 0.3, 50),
             ttft("tp2-native-fs-query", "native_fs", "threads16", 81920, 1.6, 51)]
    return recs


def test_the_report_has_a_tp_section_with_ratios_ranks_and_checks():
    text, md, summary = build_report(tp_records(hit_tokens=[5, 6, 7]))
    tp = summary["tp"]["tp2"]
    assert tp[81920] == {"recompute": 2.0, "pykv_disk": 0.4, "native_fs": 1.6, "load_blocks_disk_per_rank": [319, 319]}
    assert "Issue 19: tensor parallelism 2 (stage T)" in text
    assert "| 81,920 | 2.000 | 0.400 | 1.600 | 5.00x | 4.00x |" in md
    for line in ("one namespace per rank, each with its shard of every block ([356, 356]): PASS",
                 "every rank's worker loaded each hit's blocks (cached tokens / 256) itself, none failed: PASS",
                 "TP=1 engine over the TP=2 tree: 0 tokens cached, 0 blocks loaded (must be 0): PASS",
                 "TP=2 engine on a document only the TP=1 engine stored: 0 tokens cached (must be 0): PASS",
                 "equals vLLM's prefix-cache hit (8192 cached): PASS"):
        assert line in text, line
    assert tp["output_equal"] is True


def test_the_report_flags_a_hit_by_the_tp1_probe_and_unequal_tokens():
    text, _, summary = build_report(tp_records(hit_tokens=[5, 6, 8], probe_cached=7936))
    assert "TP=1 engine over the TP=2 tree: 7936 tokens cached, 0 blocks loaded (must be 0): FAIL" in text
    assert "DIFFERS FROM vLLM's prefix-cache hit (8192 cached): [5, 6, 8] vs [5, 6, 7]: FAIL" in text
    assert summary["tp"]["tp2"]["output_equal"] is False


def test_the_main_tables_recompute_is_stage_as_not_stage_ts():
    recs = tp_records(hit_tokens=[5, 6, 7])
    recs.append({"kind": "ttft", "label": "pykv-virtio-query-header", "system": "pykv", "medium": "virtio",
                 "variant": "header", "phase": "query", "length": 8192, "doc": 0, "ttft": 0.08, "cached": 7936,
                 "expected_cached": 7936, "ts": 60})
    _, _, summary = build_report(recs)
    assert summary["media"]["virtio"]["lengths"][8192]["recompute"] == 0.1  # stage A's, not T's 0.5
