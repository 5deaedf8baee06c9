"""The preloading stages' floor and report (issue 19: preloading against the floor;
benchmarks/h200bench/preload_floor.py, preload_report.py) and the loop image guard of run 12."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from h200bench.loop import LoopDevices  # noqa: E402
from h200bench.preload_floor import burst_floor, simulate  # noqa: E402
from h200bench.preload_report import burst_lines  # noqa: E402
from h200bench.preload_workload import burst_docs, workload  # noqa: E402


def test_misses_one_at_a_time_wait_for_each_other_on_the_gpu():
    mean, wall = simulate([None, None, None], concurrency=3, prefill_s=1.0, first_read_s=0.5, dram_read_s=0.0)
    assert mean == pytest.approx((1 + 2 + 3) / 3)
    assert wall == pytest.approx(3.0)


def test_a_document_is_read_from_the_medium_once_and_from_dram_after():
    mean, wall = simulate([0, 0, 1], concurrency=8, prefill_s=1.0, first_read_s=2.0, dram_read_s=0.25)
    # doc 0 at 2.0, again from DRAM at 2.25, doc 1 from the medium at 4.25
    assert mean == pytest.approx((2.0 + 2.25 + 4.25) / 3)
    assert wall == pytest.approx(4.25)


def test_the_gpu_and_the_medium_work_in_parallel_and_the_wall_is_the_busier_one():
    hits = burst_docs(50, 4)
    _, wall = simulate(hits, concurrency=50, prefill_s=0.88, first_read_s=1.0, dram_read_s=0.0)
    assert wall == pytest.approx(25 * 0.88)
    _, wall = simulate(hits, concurrency=50, prefill_s=0.1, first_read_s=1.0, dram_read_s=0.0)
    assert wall == pytest.approx(4 * 1.0)


def test_concurrency_delays_admission_and_ttft_counts_from_admission():
    # one in flight: each request starts when the previous ends, so each TTFT is its own cost
    mean, wall = simulate([None, 0, None], concurrency=1, prefill_s=1.0, first_read_s=3.0, dram_read_s=0.0)
    assert mean == pytest.approx((1 + 3 + 1) / 3)
    assert wall == pytest.approx(5.0)


def test_the_burst_docs_are_the_workloads_own():
    requests = workload(256, 10, 3, 1000, "x")
    assert [r["doc"] for r in requests] == burst_docs(10, 3)


def burst(**kw) -> dict:
    rows = [{"hit": d is not None} for d in burst_docs(8, 2)]
    base = {"kind": "burst", "stage": "P40", "system": "pykv", "variant": "preload-off", "length": 1024,
            "requests": 8, "concurrency": 4, "docs": 2, "wall_s": 5.0, "rows": rows,
            "ttft": {"all": {"mean": 2.0, "p90": 3.0}, "hit": {"mean": 2.5, "p90": 3.0},
                     "miss": {"mean": 1.5, "p90": 2.0}},
            "kv_bytes_per_token": 1_000_000, "worker_delta": {}}
    return {**base, **kw}


def lease(*extra: dict) -> list[dict]:
    fills = [{"kind": "ttft", "stage": "P40", "phase": "fill", "length": 1024, "ttft": t} for t in (0.5, 0.4, 0.6)]
    s1 = {"kind": "bw", "stage": "S1", "what": "odirect_read_agg", "devices": 1, "gb_per_s": 2.048}
    s1_eight = {"kind": "bw", "stage": "S1", "what": "odirect_read_agg", "devices": 8, "gb_per_s": 20.0}
    return [*fills, s1, s1_eight, *extra]


def test_the_floor_takes_the_fills_prefill_and_the_one_device_rate_of_the_lease():
    floor = burst_floor(burst(), lease())
    assert floor is not None
    assert floor.prefill_s == 0.5 and floor.read_gb_per_s == 2.048 and floor.h2d_gb_per_s is None
    assert "S1" in floor.read_source
    # 4 misses x 0.5 s on the GPU; 2 documents x 1.024 GB / 2.048 GB/s on the medium
    assert floor.wall_s == pytest.approx(max(4 * 0.5, 2 * 0.5))


def test_the_stages_own_probe_and_h2d_come_first():
    own = {"kind": "bw", "stage": "P40", "what": "odirect_read", "gb_per_s": 4.096}
    h2d = {"kind": "bw", "stage": "P40", "what": "h2d", "gb_per_s": 50.0}
    floor = burst_floor(burst(), lease(own, h2d))
    assert floor.read_gb_per_s == 4.096 and floor.h2d_gb_per_s == 50.0 and "own" in floor.read_source


def test_no_floor_without_the_fills_prefill_or_a_medium_rate():
    assert burst_floor(burst(), [r for r in lease() if r["kind"] != "ttft"]) is None
    assert burst_floor(burst(), [r for r in lease() if r["kind"] != "bw"]) is None


def test_kv_size_comes_from_a_disk_hit_of_the_lease_for_older_bursts():
    hit = {"kind": "ttft", "stage": "S1", "phase": "query", "length": 8192, "cached": 8192,
           "kv_bytes": 8192 * 1_000_000, "ttft": 0.1}
    assert burst_floor(burst(kv_bytes_per_token=None), lease()) is None
    assert burst_floor(burst(kv_bytes_per_token=None), lease(hit)).wall_s == pytest.approx(2.0)


def test_the_report_sets_every_burst_against_its_floor():
    on = burst(variant="preload-on", ttft={"all": {"mean": 2.5, "p90": 3.0}, "hit": {"mean": 3.0, "p90": 3.0},
                                          "miss": {"mean": 2.0, "p90": 2.0}})
    lines = burst_lines(lease(burst(), on))
    text = "\n".join(lines)
    floor = burst_floor(burst(), lease())
    assert f"| {2.0 / floor.mean_s:.2f}x | {5.0 / floor.wall_s:.2f}x |" in text
    assert f"| {2.5 / floor.mean_s:.2f}x |" in text
    assert "preload speed-up (mean TTFT, all requests, 1 + 1 bursts) 0.80x" in text
    assert text.count("\nfloor: one cold prefill 0.500 s") == 1
    assert f"| {2.0 / floor.in_order_mean_s:.2f}x |" in text


def test_a_loop_image_below_64_mib_is_refused_before_any_command(tmp_path):
    # run 12: stage P40 handed the native tier's image the bytes its tree reset removed (0)
    loops = LoopDevices(tmp_path, shm=str(tmp_path), mount_base=str(tmp_path), dry=False, smoke=False,
                        record=lambda r: None)
    with pytest.raises(ValueError, match="an image of 0 bytes"):
        loops.make("preload-fs", 0, stage="P40")
    assert not list(tmp_path.iterdir())


def test_in_vllms_order_a_ready_hit_still_waits_for_the_misses_before_it():
    # a miss (1 s on the GPU), then a hit already in DRAM: free at once, or after the miss in order
    free, _ = simulate([None, 0], concurrency=2, prefill_s=1.0, first_read_s=0.0, dram_read_s=0.0)
    ordered, _ = simulate([None, 0], concurrency=2, prefill_s=1.0, first_read_s=0.0, dram_read_s=0.0, in_order=True)
    assert free == pytest.approx((1.0 + 0.0) / 2)
    assert ordered == pytest.approx((1.0 + 1.0) / 2)


def test_the_in_order_floor_is_never_below_the_free_order_floor():
    for concurrency in (1, 2, 8):
        hits = burst_docs(20, 3)
        free, _ = simulate(hits, concurrency, 0.9, 1.1, 0.1)
        ordered, _ = simulate(hits, concurrency, 0.9, 1.1, 0.1, in_order=True)
        assert ordered >= free - 1e-9
    floor = burst_floor(burst(), lease())
    assert floor.in_order_mean_s >= floor.mean_s


def test_in_order_a_hit_reading_its_document_does_not_hold_up_the_misses_behind_it():
    # vLLM sets a loading hit aside and schedules the next request: the miss runs during the read
    mean, wall = simulate([0, None], concurrency=2, prefill_s=1.0, first_read_s=5.0, dram_read_s=0.0, in_order=True)
    assert mean == pytest.approx((5.0 + 1.0) / 2)
    assert wall == pytest.approx(5.0)
