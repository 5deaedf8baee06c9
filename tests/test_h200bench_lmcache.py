"""Stage LM of the H200 benchmark (issue 38, benchmarks/h200bench/lmcache_stage.py): the plan of its
engines, LMCache's settings, the install of the carried wheels and the report's LMCache columns and
section (no engine runs here: LMCache needs CUDA)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from h200bench import lmcache_stage  # noqa: E402
from h200bench.cli import add_run_options  # noqa: E402
from h200bench.report import build_report  # noqa: E402
from h200bench.stages import StageRunner  # noqa: E402


def runner_for(tmp_path: Path, *options: str) -> StageRunner:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    add_run_options(ap)
    return StageRunner(ap.parse_args(["--work", str(tmp_path / "work"), "--mount-base", str(tmp_path / "mnt"),
                                      "--shm", str(tmp_path / "shm"), *options]))


def test_the_dry_run_plans_a_fill_engine_that_queries_after_dropping_the_page_cache_and_a_fresh_engine(tmp_path):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "h200_connector.py"), "stage", "LM", "--dry-run",
                             "--work", str(tmp_path / "work"), "--mount-base", str(tmp_path / "mnt"),
                             "--shm", str(tmp_path / "shm")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    engines = [line for line in result.stdout.splitlines() if line.startswith("  engine ")]
    assert engines == [
        "  engine lmcache-loop: system=lmcache medium=loop variant=same-engine docs=1 "
        "steps=['fill', 'settle', 'settle', 'drop_caches', 'query/query']",
        "  engine lmcache-loop-fresh: system=lmcache medium=loop variant=fresh-engine docs=1 steps=['query/query']"]
    configs = [json.loads(line.split("kv_transfer_config: ", 1)[1]) for line in result.stdout.splitlines()
               if "kv_transfer_config: " in line]
    assert configs == [{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}] * 2
    settings = json.loads(result.stdout.split("LMCACHE_CONFIG_FILE ", 1)[1].split(": ", 1)[1].splitlines()[0])
    assert settings == {"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 20.0,
                        "local_disk": f"file://{tmp_path / 'mnt'}/pykv-h200-lmcache/lmcache/",
                        "max_local_disk_size": 17.0}
    assert f"ext4 on {tmp_path / 'mnt'}/pykv-h200-lmcache" in result.stdout


def test_lmcaches_cpu_buffer_holds_twice_the_largest_document_unless_set(tmp_path):
    assert lmcache_stage.cpu_gib(runner_for(tmp_path)) == 20.0  # 80k tokens of the 3B shape: 8.75 GiB
    assert lmcache_stage.cpu_gib(runner_for(tmp_path, "--lengths", "1024")) == 5.0  # LMCache's default
    assert lmcache_stage.cpu_gib(runner_for(tmp_path, "--lmcache-cpu-gib", "32")) == 32.0
    assert lmcache_stage.expected_files(runner_for(tmp_path)) == 32 + 128 + 320 + 4  # and the warm-up's


def test_the_stage_is_skipped_on_vllm_cpu(tmp_path):
    (tmp_path / "model").mkdir()
    result = subprocess.run([sys.executable, str(BENCHMARKS / "h200_connector.py"), "stage", "LM", "--cpu-smoke",
                             "--model-dir", str(tmp_path / "model"), "--work", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "stage LM: skipped in --cpu-smoke" in result.stdout
    assert not (tmp_path / "work" / "cfg" / "lmcache-loop.yaml").exists()
    assert "lmcache-loop: start" not in result.stdout


def fake_wheel(folder: Path, name: str, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_the_carried_wheels_are_installed_once_and_a_missing_lmcache_wheel_is_said(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    fake_wheel(wheels, "caio", "0.12.10")
    assert not lmcache_stage.install(wheels, target)  # aiofile's dependency alone: no LMCache
    assert not lmcache_stage.install(tmp_path / "nowhere", target)
    fake_wheel(wheels, "lmcache", lmcache_stage.VERSION)
    assert lmcache_stage.install(wheels, target)
    assert (target / "lmcache" / "__init__.py").exists() and (target / "caio" / "__init__.py").exists()
    for wheel in wheels.glob("*.whl"):
        wheel.unlink()
    assert lmcache_stage.install(wheels, target)  # already there: nothing to install from is fine


def test_only_lmcaches_engines_get_its_site_last_on_the_path_and_its_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/shim:/tmp/site")
    runner = runner_for(tmp_path)
    with lmcache_stage.lmcache_env(runner, tmp_path / "lmcache-site", tmp_path / "lmcache.yaml"):
        env = runner.env()
        assert env["PYTHONPATH"].split(os.pathsep)[1:] == ["/tmp/shim", "/tmp/site", str(tmp_path / "lmcache-site")]
        assert env["LMCACHE_CONFIG_FILE"] == str(tmp_path / "lmcache.yaml")
    assert "LMCACHE_CONFIG_FILE" not in runner.env()
    assert str(tmp_path / "lmcache-site") not in runner.env()["PYTHONPATH"]


def lm_records(*, fresh_cached: int = 0) -> list[dict]:
    def ttft(label, system, variant, phase, length, t, ts, cached=None):
        expected = (length - 1) // 256 * 256
        return {"kind": "ttft", "label": label, "system": system, "medium": "loop", "variant": variant,
                "phase": phase, "length": length, "doc": 0, "ttft": t, "ts": ts, "expected_cached": expected,
                "cached": expected if cached is None else cached}

    recs = []
    for i, (length, pykv, nfs, fill, same, fresh) in enumerate(((32768, 0.30, 0.98, 0.70, 1.067, 0.66),
                                                                (81920, 0.65, 2.29, 3.00, 3.178, 2.75))):
        recs += [ttft("pykv-loop-query-header", "pykv", "header", "query", length, pykv, 10 + i),
                 ttft("native-fs-loop-query", "native_fs", "", "query", length, nfs, 20 + i),
                 ttft("lmcache-loop", "lmcache", "same-engine", "fill", length, fill, 30 + i, cached=0),
                 ttft("lmcache-loop", "lmcache", "same-engine", "query", length, same, 40 + i),
                 ttft("lmcache-loop-fresh", "lmcache", "fresh-engine", "query", length, fresh, 50 + i,
                      cached=fresh_cached)]
    return recs


def test_the_report_puts_lmcache_beside_pykv_and_the_native_fs_tier_and_says_what_a_fresh_engine_found():
    text, md, summary = build_report(lm_records())
    loop = summary["media"]["loop"]["lengths"][81920]
    assert loop["lmcache"] == 3.178 and loop["lmcache_fresh"] == 2.75
    assert round(loop["lmcache_vs_pykv"], 2) == round(3.178 / 0.65, 2)
    assert "LMCache fresh engine" in text and "LMCache/pykv" in text
    lm = summary["lmcache"]["lengths"]
    assert lm[81920]["fill"] == 3.0 and lm[81920]["fresh_cached"] == [0]
    assert round(lm[32768]["same_vs_native_fs"], 3) == round(1.067 / 0.98, 3)
    assert "Issue 38: LMCache 0.5.3 (local_disk)" in md
    assert not [w for w in summary["warnings"] if "LMCache" in w]
    _, _, summary = build_report(lm_records(fresh_cached=32512))
    assert any("LMCache fresh engine L=32,768" in w and "cached 32512" in w for w in summary["warnings"])


def test_the_report_without_lmcache_records_has_no_lmcache_section():
    _, md, summary = build_report([r for r in lm_records() if r["system"] != "lmcache"])
    assert "lmcache" not in summary and "Issue 38" not in md and "LMCache" not in md


def test_without_the_carried_wheels_the_stage_fails_with_a_skipped_record_and_makes_no_device(tmp_path):
    (tmp_path / "model").mkdir()
    runner = runner_for(tmp_path, "--model-dir", str(tmp_path / "model"), "--lmcache-wheels", str(tmp_path / "none"))
    runner.run(["LM"])
    records = [json.loads(line) for line in runner.results.read_text().splitlines()]
    assert [(r["kind"], r.get("label"), r.get("why")) for r in records] == [
        ("skipped", "lmcache-loop", "LMCache not installed"), ("stage", None, None)]
    assert runner.failed and not list((tmp_path / "work").glob("loop-*.json")) and runner.extra_env == {}
