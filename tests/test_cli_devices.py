"""Repeated ``--root`` (a device set) in config, serve, warm, calibrate and demo, and ``pykv bench``
over several ``--path``: no engine starts here (the warm run over a set: tests/test_warm.py)."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from pykv.bench import BenchResult, bench_files, bench_raw_set, run_bench
from pykv.commands.app import app
from pykv.errors import InputError

MIB = 1 << 20


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def extra_config(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["kv_connector_extra_config"]


# -- config -------------------------------------------------------------------------------------
def test_config_prints_roots_for_several_and_root_for_one(tmp_path):
    a, b, c = (tmp_path / name for name in "abc")
    for root in (a, b, c):
        root.mkdir()
    several = extra_config(invoke("config", "--root", a, "--roots", b, "--root", c))
    assert several["roots"] == [str(a), str(b), str(c)] and "root" not in several
    one = extra_config(invoke("config", "--roots", a))
    assert one["root"] == str(a) and "roots" not in one


ENGINE_COMMANDS = [["serve", "m", "--dry-run"], ["warm", "PROMPTS", "--model", "m"], ["demo"],
                   ["calibrate", "--model", "m", "--no-plot"], ["config"]]


def command_args(command, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n')
    return [str(prompts) if word == "PROMPTS" else word for word in command]


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_roots_lists_a_device_set_in_every_engine_command(tmp_path, command):
    """``--roots A B C`` is ``--root A --root B --root C`` everywhere: a missing third is named in both."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    args = command_args(command, tmp_path)
    listed = invoke(*args, "--roots", tmp_path / "a", tmp_path / "b", tmp_path / "gone")
    repeated = invoke(*args, "--root", tmp_path / "a", "--root", tmp_path / "b", "--root", tmp_path / "gone")
    for result in (listed, repeated):
        assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.output
        assert "gone" in result.stderr and "does not exist" in result.stderr
    assert listed.stderr == repeated.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "p.jsonl"]


@pytest.mark.parametrize("command", [c for c in ENGINE_COMMANDS if c[0] != "calibrate"])
def test_one_missing_root_is_refused_as_one_of_a_set_is(tmp_path, command):
    """One rule for one root and several: no engine command makes a root (``pykv init`` does)."""
    result = invoke(*command_args(command, tmp_path), "--root", tmp_path / "kv")
    assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.output
    assert f"--root: {tmp_path / 'kv'} does not exist; create it with `pykv init {tmp_path / 'kv'}`" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


# -- serve ---------------------------------------------------------------------------------------
def test_serve_passes_roots_to_the_engine(tmp_path):
    pytest.importorskip("vllm")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    result = invoke("serve", "m", "--root", tmp_path / "a", "--root", tmp_path / "b", "--dry-run")
    assert result.exit_code == 0, result.output
    words = shlex.split(result.stdout)
    extra = json.loads(words[words.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["roots"] == [str(tmp_path / "a"), str(tmp_path / "b")] and "root" not in extra


@pytest.mark.parametrize("command", [["serve", "m"], ["warm", "PROMPTS", "--model", "m"], ["demo"],
                                     ["calibrate", "--model", "m", "--no-plot"]])
def test_a_missing_device_is_refused_in_one_line_before_anything_starts(tmp_path, command):
    (tmp_path / "a").mkdir()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n')
    args = [str(prompts) if word == "PROMPTS" else word for word in command]
    result = invoke(*args, "--root", tmp_path / "a", "--root", tmp_path / "gone")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "gone" in result.stderr and "does not exist" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "p.jsonl"]  # nothing made
    assert list((tmp_path / "a").iterdir()) == []


# -- warm and calibrate: the plans carry the set ------------------------------------------------
def test_warm_plan_carries_every_root():
    from pykv.jobs.warm import WarmPlan
    plan = WarmPlan.from_json(WarmPlan(model="m", root="/a", roots=["/a", "/b"], prompts=[]).to_json())
    assert plan.root_paths == ["/a", "/b"]
    assert WarmPlan(model="m", root="/a", prompts=[]).root_paths == ["/a"]


def test_calibration_engines_use_a_scratch_tree_on_every_device(tmp_path):
    from pykv.jobs.calibrate_plan import CalibrationRun, plan_phases
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    run = CalibrationRun(model="m", root=roots[0], roots=roots, lengths=[256], repeat=1)
    scratches = [root / "scratch" for root in roots]
    for phase in plan_phases(run, scratches, tmp_path / "work", dram_bytes=1 << 20)[1:]:
        extra = phase.engine["kv_transfer_config"]["kv_connector_extra_config"]
        assert extra["roots"] == [str(s) for s in scratches] and "root" not in extra
    with pytest.raises(InputError, match="--set roots"):
        CalibrationRun(model="m", root=roots[0], lengths=[256], settings={"roots": [str(r) for r in roots]})
    with pytest.raises(InputError, match=r"gone does not exist; create it with `pykv init"):
        CalibrationRun(model="m", root=roots[0], roots=[roots[0], tmp_path / "gone"], lengths=[256])


# -- bench over several paths --------------------------------------------------------------------
def test_raw_set_moves_every_byte_on_every_device(tmp_path):
    files = [tmp_path / "a.dat", tmp_path / "b.dat", tmp_path / "c.dat"]
    results = bench_raw_set("threadpool", files, size=4 * MIB, block_size=MIB, depth=2, device="all")
    assert [(r.op, r.bytes, r.device) for r in results] == [("write", 12 * MIB, "all"), ("read", 12 * MIB, "all")]
    assert all(f.stat().st_size == 4 * MIB for f in files)


def test_files_pass_over_a_device_set_spreads_blocks_and_cleans_up(tmp_path):
    directories = [tmp_path / "a", tmp_path / "b"]
    for d in directories:
        d.mkdir()
    results = bench_files("threadpool", directories, size=4 * MIB, block_size=MIB, depth=2)
    assert [(r.op, r.bytes) for r in results] == [("write", 8 * MIB), ("read", 8 * MIB)]
    assert all(list(d.iterdir()) == [] for d in directories)


def test_run_bench_over_several_directories_reports_aggregate_and_each_device(tmp_path):
    directories = [tmp_path / "a", tmp_path / "b"]
    results = run_bench(directories, depths=[2], block_size=MIB, size=2 * MIB, engines=("threadpool",),
                        with_fio=False)
    rows = {(r.engine, r.op, r.device): r.bytes for r in results}
    assert rows[("pykv threadpool", "read", "all")] == 4 * MIB
    assert rows[("pykv threadpool", "read", str(directories[0]))] == 2 * MIB
    assert rows[("pykv threadpool", "read", str(directories[1]))] == 2 * MIB
    assert rows[("pykv reactor files (threadpool)", "read", "all")] == 4 * MIB


def test_bench_cli_with_several_paths_names_the_given_paths(tmp_path):
    paths = [tmp_path / "a", tmp_path / "b"]
    for p in paths:
        p.mkdir()
    result = invoke("bench", "--path", paths[0], "--path", paths[1], "--size", "2M", "--block-size", "1M",
                    "--depth", "2", "--no-fio", "--no-files", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["paths"] == [str(p) for p in paths] and "path" not in data
    assert {r["device"] for r in data["results"]} == {"all", *map(str, paths)}
    assert "device" in invoke("bench", "--path", paths[0], "--path", paths[1], "--size", "2M", "--block-size", "1M",
                              "--depth", "2", "--no-fio", "--no-files").stdout
    one = json.loads(invoke("bench", "--path", paths[0], "--size", "2M", "--block-size", "1M", "--depth", "2",
                            "--no-fio", "--no-files", "--json").stdout)
    assert one["path"] == str(paths[0]) and all("device" not in r for r in one["results"])


def test_bench_result_as_dict_leaves_out_an_unset_device():
    assert "device" not in BenchResult("e", "read", 1, 1, 1, 1.0).as_dict()
    assert BenchResult("e", "read", 1, 1, 1, 1.0, "all").as_dict()["device"] == "all"


def test_the_calibration_file_records_the_device_set_and_reads_back(tmp_path):
    from pykv.calibration import Calibration
    from pykv.jobs.calibrate import _read_bandwidth
    from pykv.jobs.calibrate_plan import CalibrationRun
    from pykv.jobs.calibrate_summary import assemble
    roots = [tmp_path / "a", tmp_path / "b"]
    for root in roots:
        root.mkdir()
    assert _read_bandwidth(bench_raw_set, roots, 4 * MIB) > 0  # all devices at once; the files removed
    assert all(list(root.iterdir()) == [] for root in roots)
    namespace = {"model": "m", "dtype": "bfloat16", "kv_layout": "L", "id": "ns1"}
    samples = [{"path": "recompute", "tokens": 256, "seconds": 0.2}, {"path": "disk", "tokens": 256, "seconds": 0.1}]

    def calibration(run):
        return assemble(run, samples, {"store": {"engine": {"namespace": namespace, "gpu": "cpu"}, "seconds": 1}},
                        direct=True, direct_note="", bandwidth=1.0, dropped={}, dram_bytes=0, per_token=None,
                        settles=[])
    several = calibration(CalibrationRun(model="m", root=roots[0], roots=roots, lengths=[256], tiers=["disk"]))
    several.save(tmp_path / "cal.json")
    medium = Calibration.load(tmp_path / "cal.json").medium
    assert medium["devices"] == [str(r) for r in roots] and medium["path"] == str(roots[0])
    one = calibration(CalibrationRun(model="m", root=roots[0], lengths=[256], tiers=["disk"]))
    assert "devices" not in one.medium and one.medium["path"] == str(roots[0])  # as before: old files alike


@pytest.mark.parametrize("command", [["serve", "m", "--dry-run"], ["warm", "PROMPTS", "--model", "m"], ["demo"]])
def test_overlapping_roots_are_refused_in_one_line(tmp_path, command):
    (tmp_path / "a" / "b").mkdir(parents=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n')
    args = [str(prompts) if word == "PROMPTS" else word for word in command]
    for second in (tmp_path / "a", tmp_path / "a" / "b"):
        result = invoke(*args, "--root", tmp_path / "a", "--root", second)
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and "overlap" in result.stderr
    assert list((tmp_path / "a").iterdir()) == [tmp_path / "a" / "b"]
