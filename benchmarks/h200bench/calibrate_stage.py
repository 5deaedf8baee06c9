"""Stage K: ``pykv calibrate`` (the library call) for one model shape on one medium, with the gated sweep.

``--cal-shape 3b|8b|32b`` on ``--cal-medium loop|virtio``; writes ``calibration-SHAPE-MEDIUM.json``
to WORK and ``--out``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from h200bench.settings import CAL_SHAPES, CHUNK, GIB, LLAMA_3_2_3B_KV_BYTES_PER_TOKEN, mk_config_candidates
from h200bench.util import log, model_info, run_cmd


def calibrate_job():
    """(CalibrationRun, run_calibration): the calibrate job, from ``pykv.jobs`` or, before the
    jobs layer, ``pykv.connector``."""
    try:
        from pykv.jobs.calibrate import CalibrationRun, run_calibration
    except ImportError:
        from pykv.connector.calibrate import CalibrationRun, run_calibration
    return CalibrationRun, run_calibration


def shape_model(runner, shape: str) -> str:
    """The model directory of ``shape``: the runner's (3B) or WORK/model-SHAPE, written by mk_config.py."""
    if shape == "3b":
        return runner.model
    model = str(runner.work / f"model-{shape}")
    if not runner.dry and not (Path(model) / "config.json").exists():
        candidates = mk_config_candidates(runner.a.device_parts)
        mk = next((m for m in candidates if os.path.exists(m)), None)
        if mk is None:
            raise RuntimeError(f"no mk_config.py for the {shape} shape (looked in {candidates})")
        run_cmd([sys.executable, mk, model, CAL_SHAPES[shape]])
    return model


def engine_args(runner) -> dict:
    """The ``vllm.LLM`` arguments of the calibration engines (the benchmark's engine settings)."""
    args = {"load_format": "dummy", "max_num_batched_tokens": 8192, "gpu_memory_utilization": runner.a.gpu_mem}
    if runner.smoke:
        args.update(block_size=32, gpu_memory_utilization=0.3)
    return args


def run(runner) -> None:
    """Stage K: one model shape on the loop device or the virtio disk, with the benchmark's pykv options."""
    a = runner.a
    CalibrationRun, _ = calibrate_job()
    shape, medium = a.cal_shape, a.cal_medium
    model = shape_model(runner, shape)
    lengths = [int(x) for x in a.cal_lengths.split(",")]
    per_token = model_info(model)["kv_bytes_per_token"] if not runner.dry else LLAMA_3_2_3B_KV_BYTES_PER_TOKEN
    need = sum(lengths) * per_token + 3 * GIB  # the scratch tree and the bandwidth probe file
    if medium == "loop":
        base = runner.loop_setup("cal", math.ceil(need * 1.15 / GIB) * GIB)
    else:
        base = os.path.join(runner.disk_dir, "cal")
    os.makedirs(base, exist_ok=True)  # calibrate measures an existing directory: it never makes a root
    calibration_run = CalibrationRun(
        model=model, root=Path(base), lengths=lengths, tiers=a.cal_tiers.split(","), repeat=a.cal_repeat or 2,
        block_tokens=CHUNK, settings=runner.pykv_settings(), engine_args=engine_args(runner),
        bandwidth_bytes=(64 << 20) if runner.smoke else 2 * GIB, check_gate=not a.no_cal_gate,
        dram_bytes=(64 << 20) if runner.smoke else None)
    try:
        calibrate_and_record(runner, calibration_run, shape=shape, medium=medium, where=base)
    finally:
        if medium == "loop" and not runner.dry:
            runner.loops.teardown_all()


def calibrate_and_record(runner, calibration_run, *, shape: str, medium: str, where: str) -> None:
    """Run the calibration, write ``calibration-SHAPE-MEDIUM.json`` to WORK and ``--out``, record its
    break-even lengths, the medium's read bandwidth and the gated sweep."""
    _, run_calibration = calibrate_job()
    if runner.dry:
        print(f"  calibrate {shape} on {medium} ({where}): lengths {calibration_run.lengths}, tiers "
              f"{calibration_run.tiers}, repeat {calibration_run.repeat}, settings {calibration_run.settings}")
        return
    os.chdir(runner.work)  # its engines run `python -m pykv...calibrate`: not the repo's pykv/ from cwd
    try:
        calibration = run_calibration(calibration_run,
                                      progress=lambda what, done, total: log(f"[{done}/{total}] {what}"))
    except Exception:
        for engine_log in Path(tempfile.gettempdir()).glob("pykv-calibrate-*/*.log"):  # kept on errors
            shutil.copyfile(engine_log, runner.work / "logs" / f"calibrate-{engine_log.name}")
        raise
    name = f"calibration-{shape}-{medium}.json"
    for directory in (runner.work, runner.out):
        if directory:
            calibration.save(Path(directory) / name)
    runner.record({"kind": "calibration", "stage": runner.stage, "shape": shape, "medium": medium, "file": name,
                   "break_even": {t: c["break_even_tokens"] for t, c in calibration.to_json()["tiers"].items()},
                   "read_gb_per_s": calibration.medium.get("read_gb_per_s"), "medium_info": calibration.medium,
                   "gate_check": calibration.details.get("gate_check")})
