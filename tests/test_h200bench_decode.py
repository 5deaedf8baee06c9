"""Stage I of the H200 benchmark (issue 19): the inter-token latency statistics, their window, the
stream, and the report's ratios and targets (benchmarks/h200bench/decode_*)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from h200bench.decode_report import build, ratios  # noqa: E402
from h200bench.decode_workload import (coverage, in_window, itl_stats, long_stream, miss_tokens,  # noqa: E402
                                       outside_window, percentile, stream_window, summarize_decodes, token_gaps)
from h200bench.report import build_report  # noqa: E402


def test_each_token_after_the_first_has_the_gap_since_the_previous_output():
    gaps = token_gaps([(1.0, 1), (1.01, 1), (1.03, 1)])
    assert [t for t, _ in gaps] == [1.01, 1.03]
    assert [round(g, 6) for _, g in gaps] == [0.01, 0.02]


def test_an_output_of_several_tokens_shares_its_gap_so_the_mean_stays_exact():
    gaps = token_gaps([(0.0, 1), (0.03, 3), (0.04, 1)])
    assert [round(g, 6) for _, g in gaps] == [0.01, 0.01, 0.01, 0.01]
    assert sum(g for _, g in gaps) == pytest.approx(0.04)


def test_the_window_takes_the_tokens_that_arrived_inside_it_and_quiet_the_rest():
    gaps = [(t, t / 10) for t in (1.0, 2.0, 3.0, 4.0, 5.0)]
    assert in_window(gaps, 2.0, 4.0) == [0.3, 0.4]
    assert outside_window(gaps, 2.0, 4.0) == [0.1, 0.2, 0.5]
    assert in_window(gaps, None, None) == [g for _, g in gaps]


def test_nearest_rank_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_itl_stats_are_in_milliseconds_and_empty_is_none():
    stats = itl_stats([0.010] * 98 + [0.050, 0.100])
    assert stats["n"] == 100 and stats["p50_ms"] == 10.0 and stats["p99_ms"] == 50.0 and stats["max_ms"] == 100.0
    assert stats["mean_ms"] == pytest.approx(11.3)
    assert itl_stats([])["mean_ms"] is None


def test_the_window_runs_from_the_first_submission_to_the_last_first_token():
    longs = [{"submitted": 1.0, "ttft": 5.0}, {"submitted": 2.0, "ttft": 0.5}, {"submitted": 3.0, "ttft": 1.0}]
    assert stream_window(longs) == (1.0, 6.0)
    assert stream_window([]) is None


def test_coverage_is_the_share_of_the_window_every_decode_was_running():
    decodes = [{"arrivals": [(0.5, 1), (10.0, 1)]}, {"arrivals": [(0.5, 1), (4.0, 1)]}]
    assert coverage(decodes, (2.0, 6.0)) == 0.5
    assert coverage(decodes[:1], (2.0, 6.0)) == 1.0


def test_summarize_decodes_splits_window_and_quiet_and_counts_merged_outputs():
    decode = {"arrivals": [(0.0, 1), (1.0, 1), (2.0, 1), (2.5, 2), (3.0, 1), (4.0, 1)]}
    out = summarize_decodes([decode], (1.5, 3.0))
    assert out["window"]["n"] == 4  # the tokens that arrived at 2.0, 2.5 (two) and 3.0
    assert out["quiet"]["n"] == 2  # at 1.0 and 4.0 (the first output is the decode's first token: no gap)
    assert out["before"]["n"] == 1 and out["before"]["mean_ms"] == 1000.0  # 0.0 -> 1.0
    assert out["after"]["n"] == 1 and out["after"]["max_ms"] == 1000.0  # 3.0 -> 4.0
    assert out["overall"]["n"] == 6 and out["tokens"] == 7 and out["merged_outputs"] == 1
    assert out["coverage"] == 1.0 and out["window_s"] == 1.5


def test_the_stream_alternates_stored_documents_and_fresh_prompts_cycling_the_lengths():
    stream = long_stream([64, 96, 160], 6, 1, 1000)
    assert [r["length"] for r in stream] == [64, 96, 160, 64, 96, 160]
    assert [r["hit"] for r in stream] == [True, False] * 3
    assert [len(r["tokens"]) for r in stream] == [96, 96, 192, 64, 128, 160]  # hits: +32 of their own
    assert stream == long_stream([64, 96, 160], 6, 1, 1000)  # the same for every configuration
    assert miss_tokens([64, 96, 160], 6) == 96 + 64 + 160


def itl_record(system: str, mean: float, p99: float, **extra) -> dict:
    stats = {"n": 100, "mean_ms": mean, "p50_ms": mean, "p99_ms": p99, "max_ms": p99}
    return {"kind": "itl", "system": system, "ts": extra.pop("ts", 1), "decode_seqs": 8, "long_requests": 12,
            "long_lengths": [32768, 49152, 81920], "long_gap_s": 1.0,
            "itl": {"window": stats, "quiet": stats, "overall": stats, "window_s": 10.0, "coverage": 1.0,
                    "tokens": 800, "merged_outputs": 0},
            "ttft": {k: {"n": 6, "mean": 1.0, "p90": 1.0} for k in ("all", "hit", "miss")},
            "longs": [{"id": "long0", "hit": True, "cached": 32768}],
            "worker_delta": {"store_blocks": 10, "load_blocks_disk": 5}, **extra}


def test_the_report_checks_pykv_against_no_connector_and_native_offloading():
    records = [itl_record("none", 20.0, 40.0), itl_record("pykv", 20.2, 42.0), itl_record("native", 21.0, 41.0)]
    rs = ratios({r["system"]: r for r in records})
    assert rs["none"]["mean"] == pytest.approx(1.01) and rs["none"]["p99"] == pytest.approx(1.05)
    section = build(records)
    lines = [line for line in section.text if "window" in line and "target" in line]
    assert any("mean ITL pykv / no connector = 1.010x" in line and "PASS" in line for line in lines)
    assert any("p99 ITL pykv / no connector = 1.050x" in line and "FAIL" in line for line in lines)
    assert any("mean ITL pykv / native offloading = 0.962x" in line and "PASS" in line for line in lines)
    assert any("p99 ITL pykv / native offloading = 1.024x" in line and "FAIL" in line for line in lines)
    assert not section.warnings



def test_the_report_compares_the_itl_after_the_window_where_the_streams_stores_drain():
    records = [itl_record("none", 20.0, 40.0), itl_record("pykv", 20.0, 40.0)]
    records[0]["itl"]["after"] = {"n": 500, "mean_ms": 18.0, "p50_ms": 18.0, "p99_ms": 19.0, "max_ms": 19.0}
    records[1]["itl"]["after"] = {"n": 500, "mean_ms": 27.0, "p50_ms": 27.0, "p99_ms": 38.0, "max_ms": 38.0}
    section = build(records)
    assert any("after-window mean ITL pykv / no connector = 1.500x (context" in line for line in section.text)
    assert any("after-window p99 ITL pykv / no connector = 2.000x" in line for line in section.text)
    assert build([itl_record("none", 20.0, 40.0), itl_record("pykv", 20.0, 40.0)]) is not None  # older records


def test_the_report_takes_each_systems_latest_record_and_warns_about_what_spoils_the_measure():
    records = [itl_record("none", 50.0, 90.0, ts=1), itl_record("none", 20.0, 40.0, ts=2),
               itl_record("pykv", 20.0, 40.0, ts=3, worker_delta={}, longs=[{"id": "long0", "hit": True,
                                                                             "cached": 0}])]
    records[2]["itl"]["coverage"] = 0.8
    section = build(records)
    assert any("pykv / no connector = 1.000x" in line and "PASS" in line for line in section.text)
    assert any("covered 80%" in w for w in section.warnings)
    assert any("no block stored" in w for w in section.warnings)
    assert any("without a cache hit: long0" in w for w in section.warnings)
    text, md, summary = build_report(records)
    assert "Issue 19" in text and "Issue 19" in md and summary["itl"]["ratios_window"]["none"]["mean"] == 1.0


def test_without_itl_records_the_report_has_no_issue_19_section():
    assert build([{"kind": "ttft"}]) is None
