"""The calibration file, the break-even fit and lengths parsing (pykv/calibration/), and the gate
check's sample checks and summary (pykv/jobs/calibrate_summary.py)."""

from __future__ import annotations

import json
import math
import os

import pytest

from pykv.calibration import (
    Calibration,
    CalibrationError,
    Point,
    TierCalibration,
    break_even_tokens,
    fit_tiers,
    parse_lengths,
    parse_tiers,
    save_plot,
)
from pykv.jobs.calibrate_summary import check_sample as _check_sample, summarize_gate
from pykv.errors import InputError, PykvError
from pykv.io.atomic import write_atomically


def points(*rows: tuple[int, float, float]) -> list[Point]:
    return [Point(n, recompute, hit) for n, recompute, hit in rows]


# -- the fit -------------------------------------------------------------------------------
def test_interpolates_the_crossing_linearly():
    # gains: -0.2 at 1024, +0.2 at 2048 -> zero halfway
    assert break_even_tokens(points((1024, 0.1, 0.3), (2048, 0.5, 0.3))) == 1536


def test_crossing_is_rounded_up_to_a_whole_token():
    assert break_even_tokens(points((0, 0.0, 1.0), (3, 2.0, 0.0))) == 1  # exact 1.0
    assert break_even_tokens(points((0, 0.0, 1.0), (10, 2.0, 0.0))) == 4  # 3.33 -> 4


def test_always_winning_gives_zero_and_never_winning_gives_infinity():
    assert break_even_tokens(points((1024, 0.2, 0.1), (2048, 0.4, 0.1))) == 0
    assert break_even_tokens(points((1024, 0.1, 0.2), (2048, 0.2, 0.4))) == math.inf


def test_a_tie_counts_as_a_win():
    assert break_even_tokens(points((1024, 0.2, 0.2), (2048, 0.4, 0.1))) == 0


def test_uses_the_last_crossing_so_every_longer_measured_length_wins():
    # noisy win at 2k, loss at 4k, wins from 8k: the threshold lies between 4k and 8k
    rows = points((1024, 0.1, 0.2), (2048, 0.25, 0.2), (4096, 0.3, 0.4), (8192, 0.9, 0.5))
    assert 4096 < break_even_tokens(rows) < 8192
    assert break_even_tokens(rows) == math.ceil(4096 + 0.1 / 0.5 * 4096)


def test_loss_at_the_longest_length_means_no_threshold():
    assert break_even_tokens(points((1024, 0.1, 0.2), (2048, 0.5, 0.2), (4096, 0.6, 0.7))) == math.inf


def test_order_of_points_does_not_matter():
    assert break_even_tokens(points((2048, 0.5, 0.3), (1024, 0.1, 0.3))) == 1536


def test_no_points_is_an_error():
    with pytest.raises(ValueError):
        break_even_tokens([])


def test_paper_like_anchor_numbers():
    # H200 anchors, Llama-3.2-3B shape, native fs tier on loop-NVMe (device README)
    rows = points((8192, 0.095, 0.29), (32768, 0.62, 1.12), (81920, 2.70, 2.73))
    assert break_even_tokens(rows) == math.inf  # loses at every measured length
    rows = points((8192, 0.095, 0.065), (32768, 0.62, 0.124), (81920, 2.70, 0.25))  # native CPU tier
    assert break_even_tokens(rows) == 0


def test_fit_tiers_takes_medians_per_length():
    samples = [{"path": "recompute", "tokens": 256, "seconds": s} for s in (0.10, 0.11, 0.50)]
    samples += [{"path": "recompute", "tokens": 512, "seconds": s} for s in (0.30, 0.31, 0.29)]
    samples += [{"path": "disk", "tokens": 256, "seconds": s} for s in (0.20, 0.90, 0.21)]
    samples += [{"path": "disk", "tokens": 512, "seconds": s} for s in (0.10, 0.12, 0.11)]
    samples += [{"path": "cold", "tokens": 256, "seconds": 0.2}]
    tiers, recompute, cold = fit_tiers(samples, ["disk"])
    assert [p["seconds"] for p in recompute] == [0.11, 0.30]
    assert [p["samples"] for p in recompute][1] == [0.30, 0.31, 0.29]
    assert cold == [{"tokens": 256, "seconds": 0.2, "samples": [0.2]}]
    disk = tiers["disk"]
    assert [(p["tokens"], p["hit_s"], p["recompute_s"]) for p in disk.points] == [(256, 0.21, 0.11), (512, 0.11, 0.30)]
    assert disk.points[0]["hit_samples"] == [0.20, 0.90, 0.21]
    assert 256 < disk.break_even_tokens < 512
    with pytest.raises(ValueError, match="no dram samples"):
        fit_tiers(samples, ["dram"])


# -- lengths and tiers ---------------------------------------------------------------------
def test_lengths_use_binary_k_and_are_sorted():
    assert parse_lengths("2k,1k,80k", multiple=256) == [1024, 2048, 81920]
    assert parse_lengths("256, 512") == [256, 512]


@pytest.mark.parametrize("text, needle", [("1000", "not a positive multiple"), ("1k,,2k", "empty entry"),
                                          ("1k,1k", "repeated"), ("lots", "cannot parse"), ("0", "positive")])
def test_bad_lengths_name_the_option(text, needle):
    with pytest.raises(InputError, match=rf"--lengths: .*{needle}"):
        parse_lengths(text, multiple=256)


def test_tiers():
    assert parse_tiers("dram, disk,dram") == ["dram", "disk"]
    with pytest.raises(InputError, match="--tiers"):
        parse_tiers("gpu")


# -- the file ------------------------------------------------------------------------------
def calibration(**overrides) -> Calibration:
    tiers = {"disk": TierCalibration.fit(points((1024, 0.1, 0.3), (2048, 0.5, 0.3))),
             "dram": TierCalibration(0, []), **overrides.pop("tiers", {})}
    values = dict(model="/models/llama", dtype="bfloat16", kv_layout="LBHNC/v29+", tiers=tiers, namespace="ab" * 16,
                  gpu="NVIDIA H200", vllm_version="0.32.0",
                  medium={"path": "/mnt/nvme", "read_gb_per_s": 6.1, "direct_io": True, "page_cache": "bypassed"},
                  details={"storage_block_tokens": 256})
    values.update(overrides)
    return Calibration(**values)


def test_round_trip_keeps_every_field(tmp_path):
    path = calibration().save(tmp_path / "cal.json")
    data = json.loads(path.read_text())
    assert data["pykv_calibration"] == 1 and data["created_at"].endswith("Z")
    assert data["tiers"]["disk"]["break_even_tokens"] == 1536 and data["tiers"]["dram"]["break_even_tokens"] == 0
    assert data["tiers"]["disk"]["points"][0] == {"tokens": 1024, "recompute_s": 0.1, "hit_s": 0.3, "gain_s": -0.2}
    loaded = Calibration.load(path)
    assert loaded.to_json() == data
    assert loaded.details == {"storage_block_tokens": 256}
    assert loaded.thresholds() == {"disk": 1536, "dram": 0}


def test_never_winning_tier_is_null_in_the_file(tmp_path):
    never = TierCalibration.fit(points((1024, 0.1, 0.3), (2048, 0.2, 0.3)))
    path = calibration(tiers={"disk": never}).save(tmp_path / "cal.json")
    assert json.loads(path.read_text())["tiers"]["disk"]["break_even_tokens"] is None
    assert Calibration.load(path).thresholds()["disk"] == math.inf


def write(tmp_path, data) -> str:
    path = tmp_path / "cal.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def good() -> dict:
    return calibration().to_json()


@pytest.mark.parametrize("mutate, field, reason", [
    (lambda d: d.pop("pykv_calibration"), "pykv_calibration", "missing"),
    (lambda d: d.update(pykv_calibration=2), "pykv_calibration", "not supported"),
    (lambda d: d.pop("model"), "model", "missing"),
    (lambda d: d.update(dtype=16), "dtype", "expected a string"),
    (lambda d: d.pop("kv_layout"), "kv_layout", "missing"),
    (lambda d: d.pop("tiers"), "tiers", "missing"),
    (lambda d: d["tiers"].update(gpu={"break_even_tokens": 1}), "tiers.gpu", "unknown tier"),
    (lambda d: d["tiers"]["disk"].pop("break_even_tokens"), "tiers.disk.break_even_tokens", "missing"),
    (lambda d: d["tiers"]["disk"].update(break_even_tokens="many"), "tiers.disk.break_even_tokens", "non-negative"),
    (lambda d: d["tiers"]["disk"].update(break_even_tokens=-1), "tiers.disk.break_even_tokens", "non-negative"),
    (lambda d: d["tiers"]["disk"].update(break_even_tokens=True), "tiers.disk.break_even_tokens", "non-negative"),
    (lambda d: d["tiers"]["disk"].update(points={}), "tiers.disk.points", "expected a list"),
    (lambda d: d.update(medium=[]), "medium", "expected an object"),
])
def test_malformed_files_name_the_file_and_field(tmp_path, mutate, field, reason):
    data = good()
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(CalibrationError, match=reason) as caught:
        Calibration.load(path)
    assert str(caught.value).startswith(f"{path}: {field}: ")
    assert caught.value.field == field and isinstance(caught.value, InputError)


@pytest.mark.parametrize("content, reason", [("{not json", "malformed JSON"), ("[1, 2]", "expected a JSON object")])
def test_unparsable_files(tmp_path, content, reason):
    path = write(tmp_path, content)
    with pytest.raises(CalibrationError, match=reason) as caught:
        Calibration.load(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_unreadable_file(tmp_path):
    with pytest.raises(CalibrationError, match=r"\(file\): cannot read"):
        Calibration.load(tmp_path / "missing.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CalibrationError, match="not UTF-8"):
        Calibration.load(tmp_path / "binary.json")


def test_engine_mismatch_names_the_field_unless_overridden():
    cal = calibration()
    engine = {"model": "/models/llama", "dtype": "bfloat16", "kv_layout": "LBHNC/v29+"}
    assert cal.check_engine(engine, source="f.json") == []
    with pytest.raises(CalibrationError, match=r"^f\.json: dtype: calibrated for 'bfloat16', this engine has "
                                               r"'float16'.*breakeven_override=true"):
        cal.check_engine({**engine, "dtype": "float16"}, source="f.json")
    with pytest.raises(CalibrationError, match=r"^f\.json: model: "):
        cal.check_engine({**engine, "model": "/models/other"}, source="f.json")
    mismatches = cal.check_engine({**engine, "model": "/m/other", "kv_layout": "HND/v26-28"}, override=True,
                                  source="f.json")
    assert [m.split(": ")[1] for m in mismatches] == ["model", "kv_layout"]


def test_a_file_calibrated_with_dtype_auto_serves_any_dtype_of_its_engine():
    """vLLM 26-31 named the KV dtype "auto"; pykv now names the resolved one. A file from then holds
    timings of the same bytes per token (bf16 or fp16), so it still gates; "auto" in an engine does not
    match a file of another dtype."""
    engine = {"model": "/models/llama", "dtype": "bfloat16", "kv_layout": "LBHNC/v29+"}
    old = calibration(dtype="auto")
    assert old.check_engine(engine) == [] and old.check_engine({**engine, "dtype": "float16"}) == []
    with pytest.raises(CalibrationError, match="model: "):
        old.check_engine({**engine, "model": "/models/other"})
    with pytest.raises(CalibrationError, match="dtype: calibrated for 'auto', this engine has 'fp8_e4m3'"):
        old.check_engine({**engine, "dtype": "fp8_e4m3"})  # an fp8 KV cache was never "auto"
    with pytest.raises(CalibrationError, match="dtype: calibrated for 'bfloat16', this engine has 'auto'"):
        calibration().check_engine({**engine, "dtype": "auto"})


def test_each_codec_has_its_calibration_and_an_old_file_is_for_none(tmp_path):
    zstd = "planes-zstd:v1,elem=2,level=1,chunk=1048576"
    engine = {"model": "/models/llama", "dtype": "bfloat16", "kv_layout": "LBHNC/v29+"}
    plain = calibration()
    assert plain.codec == "none" and plain.check_engine(engine) == []
    with pytest.raises(CalibrationError, match=r"codec: calibrated for 'none', this engine has 'planes-zstd:v1"):
        plain.check_engine({**engine, "codec": zstd})
    coded = calibration(codec=zstd)
    coded.save(tmp_path / "coded.json")
    loaded = Calibration.load(tmp_path / "coded.json")
    assert loaded.codec == zstd and loaded.check_engine({**engine, "codec": zstd}) == []
    with pytest.raises(CalibrationError, match="codec: calibrated for 'planes-zstd"):
        loaded.check_engine(engine)  # an engine without a codec
    old = loaded.to_json()
    del old["codec"]  # a file written before codecs
    assert Calibration.from_json(old).codec == "none"
    with pytest.raises(CalibrationError, match="codec: expected a string"):
        Calibration.from_json({**old, "codec": 7})


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "cal.json"
    target.write_text("old")

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, b"new content")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.json"]


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = save_plot(calibration(), tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


# -- the gate check (jobs/calibrate_summary.py) -------------------------------------------------
def gated(tokens: int, cached: int, disk: int = 0, dram: int = 0) -> dict:
    return {"event": "sample", "path": "gated", "tokens": tokens, "rep": 0, "warmup": False, "seconds": 0.1,
            "cached_tokens": cached, "loaded": {"disk": disk, "dram": dram}}


def test_gated_sample_is_admitted_when_it_loaded_everything_from_disk():
    sample = _check_sample(gated(1024, 1024, disk=4), block_tokens=256)
    assert sample["admitted"] is True and sample["seconds"] == 0.1


def test_gated_sample_is_refused_when_it_loaded_nothing():
    assert _check_sample(gated(1024, 0), block_tokens=256)["admitted"] is False


@pytest.mark.parametrize("sample", [gated(1024, 512, disk=2), gated(1024, 1024, disk=3),
                                    gated(1024, 1024, disk=4, dram=1), gated(1024, 0, disk=2),
                                    gated(1024, 1024, dram=4)], ids=["half", "short", "dram-too", "blocks-no-tokens",
                                                                     "from-dram"])
def test_partial_or_foreign_gated_loads_are_errors(sample):
    with pytest.raises(PykvError, match=r"^gated run at 1,024 tokens loaded .*expected all from disk \(admitted\) "
                                        r"or none \(refused\)"):
        _check_sample(sample, block_tokens=256)


def test_other_paths_keep_their_checks():
    disk = {**gated(512, 512, disk=2), "path": "disk"}
    assert "admitted" not in _check_sample(disk, block_tokens=256)
    with pytest.raises(PykvError, match="^disk hit at 512 tokens loaded 0 tokens"):
        _check_sample({**gated(512, 0), "path": "disk"}, block_tokens=256)
    with pytest.raises(PykvError, match=r"dram hit .*expected all from dram \(raise --dram-bytes\)"):
        _check_sample({**gated(512, 512, disk=2), "path": "dram"}, block_tokens=256)
    with pytest.raises(PykvError, match="recompute run at 512 tokens reused 256 tokens"):
        _check_sample({**gated(512, 256), "path": "recompute"}, block_tokens=256)


def test_a_miss_sample_must_find_nothing():
    miss = {**gated(512, 0), "path": "miss"}
    assert _check_sample(miss, block_tokens=256) == miss
    for bad in ({**gated(512, 256), "path": "miss"}, {**gated(512, 0, disk=1), "path": "miss"}):
        with pytest.raises(PykvError, match=r"^miss run at 512 tokens loaded .*expected nothing \(a prompt no "
                                            r"engine stored\)$"):
            _check_sample(bad, block_tokens=256)


def runs(path: str, tokens: int, *seconds: float, admitted: bool | None = None) -> list[dict]:
    extra = {} if admitted is None else {"admitted": admitted}
    return [{"path": path, "tokens": tokens, "seconds": s, **extra} for s in seconds]


def test_gate_check_compares_the_gated_median_with_the_better_path():
    samples = (runs("recompute", 256, 0.10, 0.12, 0.11) + runs("disk", 256, 0.20, 0.21, 0.19)
               + runs("gated", 256, 0.50, 0.115, 0.11, admitted=False)           # median 0.115 / 0.11
               + runs("recompute", 512, 0.30, 0.30, 0.30) + runs("disk", 512, 0.10, 0.12, 0.11)
               + runs("gated", 512, 0.2, 0.2, admitted=True) + runs("gated", 512, 0.01, admitted=False)  # 0.2 / 0.11
               + runs("cold", 512, 9.0) + runs("dram", 512, 0.01))               # not part of the check
    check = summarize_gate(samples)
    short, long = check["points"]
    assert (short["tokens"], short["recompute_s"], short["disk_s"], short["best_s"]) == (256, 0.11, 0.2, 0.11)
    assert short["gated_s"] == 0.115 and short["ratio"] == round(0.115 / 0.11, 4) == 1.0455 and short["ok"] is True
    assert (short["admitted"], short["runs"], short["gated_samples"]) == (0, 3, [0.50, 0.115, 0.11])
    assert (long["best_s"], long["gated_s"], long["ratio"], long["ok"]) == (0.11, 0.2, 1.8182, False)
    assert (long["admitted"], long["runs"]) == (2, 3)
    assert check["max_ratio"] == 1.8182 and check["all_ok"] is False and check["tolerance"] == 1.05
    # the decisions: 256 recomputed (0.11 is best: right); 512 loaded twice (0.11, best: right) and
    # recomputed once (0.30 > 1.05 x 0.11: wrong)
    assert short["right"] is True and long["right"] is False and check["all_right"] is False
    assert json.loads(json.dumps(check)) == check  # goes into the file as it is


def test_gate_check_tolerance_is_inclusive_and_absent_without_gated_runs():
    base = runs("recompute", 256, 1.0) + runs("disk", 256, 2.0)
    at_limit = summarize_gate(base + runs("gated", 256, 1.05, admitted=False))
    over = summarize_gate(base + runs("gated", 256, 1.06, admitted=False))
    assert at_limit["all_ok"] is True and at_limit["max_ratio"] == 1.05
    assert over["all_ok"] is False and over["points"][0]["ok"] is False
    assert summarize_gate(base) is None


def test_gate_check_separates_a_right_decision_from_the_connectors_cost():
    """Recompute wins at 256 and the gate refused, but the gated engine was slower than vLLM
    alone (its connector): right decision, not within the tolerance. At 512 loading wins by
    less than the tolerance, so recomputing is right too."""
    samples = (runs("recompute", 256, 0.10) + runs("disk", 256, 0.30) + runs("gated", 256, 0.12, admitted=False)
               + runs("recompute", 512, 0.104) + runs("disk", 512, 0.10) + runs("gated", 512, 0.104, admitted=False))
    check = summarize_gate(samples)
    assert [(p["right"], p["ok"]) for p in check["points"]] == [(True, False), (True, True)]
    assert check["all_right"] is True and check["all_ok"] is False


def test_gate_check_gives_the_gates_own_decision_time_beside_the_paths():
    """The gate's cost is measured in the gated engine itself (same path): its median decision time
    and its share of the better path, where the samples carry the scheduler's ``gate_us``."""
    gated = [{**run, "gate_us": us} for run, us in zip(runs("gated", 256, 0.12, 0.13, 0.12, admitted=False), (30, 90, 50))]
    check = summarize_gate(runs("recompute", 256, 0.10) + runs("disk", 256, 0.30) + gated)
    point = check["points"][0]
    assert point["gate_s"] == 50e-6 and point["gate_share"] == round(50e-6 / 0.10, 6) == 0.0005
    assert "gate_s" not in summarize_gate(runs("recompute", 256, 0.10) + runs("disk", 256, 0.30)
                                          + runs("gated", 256, 0.12, admitted=False))["points"][0]


def test_gate_check_measures_the_better_path_in_the_gated_engine_when_it_ran_misses():
    """With misses (prompts no engine stored) the recompute path is the gated engine's own, and an
    admitted length's load path is its own loads less the gate's decision: the verdict is about the
    gate, not about one fresh engine against another. ``ratio_engines`` keeps the old comparison."""
    # 256: refused; this engine recomputes 20 % slower than the recompute engine, refusals as fast as misses
    short = (runs("recompute", 256, 0.10) + runs("disk", 256, 0.30) + runs("gated", 256, 0.12, 0.121, 0.119,
                                                                          admitted=False)
             + runs("miss", 256, 0.121, 0.12, 0.125))
    # 512: admitted; its loads 0.2 with a 1 ms decision, the disk engine's 0.15, misses 0.5
    gated = [{**run, "gate_us": 1000} for run in runs("gated", 512, 0.2, 0.2, 0.2, admitted=True)]
    long = runs("recompute", 512, 0.5) + runs("disk", 512, 0.15) + gated + runs("miss", 512, 0.5, 0.5)
    check = summarize_gate(short + long)
    a, b = check["points"]
    assert (a["miss_s"], a["best_s"], a["ratio"], a["ok"]) == (0.121, 0.121, round(0.12 / 0.121, 4), True)
    assert a["ratio_engines"] == 1.2 and a["miss_samples"] == [0.121, 0.12, 0.125]
    assert (b["best_s"], b["ratio"], b["ok"], b["ratio_engines"]) == (0.199, round(0.2 / 0.199, 4), True,
                                                                      round(0.2 / 0.15, 4))
    assert check["all_ok"] is True and check["max_ratio"] == round(0.2 / 0.199, 4)


@pytest.mark.parametrize("case", ["costly gate", "wrong load", "wrong refusal"])
def test_gate_check_with_misses_still_fails_a_costly_gate_or_a_wrong_path(case):
    if case == "costly gate":  # loads of 0.1 s of which the decision took 20 ms: 0.1 / 0.08
        samples = ([{**r, "gate_us": 20_000} for r in runs("gated", 512, 0.1, 0.1, admitted=True)]
                   + runs("miss", 512, 0.5) + runs("recompute", 512, 0.5) + runs("disk", 512, 0.1))
        expected = 1.25
    elif case == "wrong load":  # loaded where this engine recomputes faster
        samples = (runs("gated", 512, 0.3, 0.3, admitted=True) + runs("miss", 512, 0.2)
                   + runs("recompute", 512, 0.2) + runs("disk", 512, 0.3))
        expected = 1.5
    else:  # refused where the disk engine loads three times faster
        samples = (runs("gated", 512, 0.3, 0.3, admitted=False) + runs("miss", 512, 0.3)
                   + runs("recompute", 512, 0.3) + runs("disk", 512, 0.1))
        expected = 3.0
    point = summarize_gate(samples)["points"][0]
    assert point["ratio"] == expected and point["ok"] is False


def test_gate_check_round_trips_through_the_file(tmp_path):
    check = summarize_gate(runs("recompute", 256, 1.0) + runs("disk", 256, 0.5) + runs("gated", 256, 0.5,
                                                                                           admitted=True))
    path = calibration(details={"storage_block_tokens": 256, "gate_check": check}).save(tmp_path / "cal.json")
    data = json.loads(path.read_text())
    assert data["pykv_calibration"] == 1 and data["gate_check"] == check
    assert Calibration.load(path).details["gate_check"] == check


def test_plot_shows_the_gated_runs(tmp_path):
    pytest.importorskip("matplotlib")
    check = summarize_gate(runs("recompute", 1024, 0.1) + runs("disk", 1024, 0.3) + runs("gated", 1024, 0.1,
                                                                                            admitted=False))
    path = save_plot(calibration(details={"gate_check": check}), tmp_path / "plot.png")
    plain = save_plot(calibration(), tmp_path / "plain.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.read_bytes() != plain.read_bytes()
    with_misses = summarize_gate(runs("recompute", 1024, 0.1) + runs("disk", 1024, 0.3)
                                 + runs("gated", 1024, 0.1, admitted=False) + runs("miss", 1024, 0.2))
    missed = save_plot(calibration(details={"gate_check": with_misses}), tmp_path / "missed.png")
    assert missed.read_bytes() != path.read_bytes()  # the misses drawn as a series of their own
