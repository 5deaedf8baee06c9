"""The engines behind ``pykv calibrate``: measure recompute and hit TTFTs, fit break-even lengths.

``run_calibration(CalibrationRun(...))`` returns a ``pykv.calibration.Calibration``
(the caller saves it). The paper's procedure (§5.2), in three fresh engine
processes (four with ``check_gate``; ``python -m pykv.jobs.calibrate_engine
PHASE.json EVENTS.jsonl``, run by ``pykv.jobs.runner``), GPU prefix caching off in all of them:

1. ``recompute`` - no connector: each length's prompt ``repeat`` times; every run
   prefills from scratch (what a refused load costs).
2. ``store`` - pykv on a scratch tree under ``--root`` (the medium measured), with a
   DRAM tier when ``dram`` is calibrated: each prompt once cold (prefill + store,
   kept as ``cold``), wait until its blocks are published, then ``repeat`` DRAM hits.
3. ``disk`` - the page cache dropped (when root), then a fresh engine on the same
   tree without a DRAM tier: each prompt ``repeat`` times, each a disk hit (pykv
   reads with O_DIRECT where the filesystem takes it, bypassing the page cache).
4. ``gated`` (``check_gate``) - the tiers fitted from phases 1-3 written to a
   calibration file, the page cache dropped again, then a fresh engine like
   ``disk`` but with that file as its ``breakeven_file``: each prompt ``repeat``
   times, each either a full disk load (admitted) or a recompute (refused), in
   turn with prompts no engine stored (``miss``: the recompute path with pykv in
   the engine) after one unmeasured miss of that length; stores off. The
   calibration's ``gate_check`` compares it per length with the better path,
   measured in this engine where it ran that path (misses; its own loads), else
   in the disk engine (``ok``: at most ``GATE_TOLERANCE`` times that;
   ``ratio_engines``: against the recompute and disk engines alone).

The prompt for length L has L + 1 tokens, so a hit loads exactly L tokens and
computes one; ``max_tokens=1``; TTFT is the wall time of ``LLM.generate``. Every
hit is checked against pykv's worker counters (``pykv.counters``): all L tokens
must come from the tier being measured, or the calibration stops with an error.
The medium's O_DIRECT read bandwidth is measured once with ``pykv.bench``.
Before measuring, each engine runs one unmeasured warm-up request of its kind.
The scratch tree and the work directory are removed at the end, also on errors
and interruptions (the work directory stays when an engine failed: the error names its log).
Every ``--root`` must exist (``require_roots``): calibration makes nothing outside them.

Modules: ``calibrate_plan`` (the options and the plan), ``calibrate_engine`` (inside an
engine process), ``calibrate_summary`` (checks and the assembled ``Calibration``), this
one (the orchestration).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from pykv.calibration import Calibration, save_plot
from pykv.counters import ENV as COUNTERS_ENV
from pykv.errors import InputError
from pykv.jobs.calibrate_plan import GATE_FILE, CalibrationRun, Phase, kv_bytes_per_token, plan_phases
from pykv.jobs.calibrate_summary import assemble, check_sample
from pykv.jobs.runner import EngineJob, JobFailed
from pykv.jobs.serve import DEFAULT_SEED, SEED_ENV

log = logging.getLogger(__name__)
ENGINE_MODULE = "pykv.jobs.calibrate_engine"
ProgressCallback = Callable[[str, int, int], None]
"""``progress(description, done, total)`` after each engine start and each measured request."""


# -- the orchestration ---------------------------------------------------------------------------
def run_calibration(run: CalibrationRun, progress: ProgressCallback | None = None) -> Calibration:
    """Measure, fit and return the calibration; see the module docstring."""
    from pykv.bench import bench_raw_set
    from pykv.io.probe import direct_io_supported

    per_token = kv_bytes_per_token(run.model, run.engine_args)
    dram_bytes = run.dram_bytes
    if dram_bytes is None and "dram" in run.tiers:
        if per_token is None:
            raise InputError(f"--dram-bytes: cannot size the DRAM tier from {run.model}/config.json; give a size "
                             f"that holds the longest prompt's KV")
        dram_bytes = int(max(run.lengths) * per_token * 1.25) + (64 << 20)
    work: Path | None = None
    scratches: list[Path] = []
    try:
        work = Path(tempfile.mkdtemp(prefix="pykv-calibrate-"))
        scratches += [Path(tempfile.mkdtemp(prefix=".pykv-calibrate-", dir=root)) for root in run.root_paths]
        phases = plan_phases(run, scratches if len(scratches) > 1 else scratches[0], work, dram_bytes or 0)
        total = sum(p.units for p in phases) + 1
        done = 0
        if progress:
            progress("measuring the medium's read bandwidth", done, total)
        notes = [direct_io_supported(scratch) for scratch in scratches]
        direct = all(ok for ok, _ in notes)
        direct_note = next((note for ok, note in notes if not ok), notes[0][1])
        bandwidth = _read_bandwidth(bench_raw_set, scratches, run.bandwidth_bytes) if direct else None
        done += 1
        samples: list[dict[str, Any]] = []
        settles: list[dict[str, Any]] = []  # the store engine's waits for its writes between lengths
        engines: dict[str, dict[str, Any]] = {}
        dropped: dict[str, str | None] = {}  # phase -> page cache outcome before it

        def fitted() -> Calibration:
            return assemble(run, samples, engines, direct=direct, direct_note=direct_note, bandwidth=bandwidth,
                             dropped=dropped, dram_bytes=dram_bytes, per_token=per_token, settles=settles)

        for phase in phases:
            if phase.name == "gated":  # the thresholds fitted so far, as the gated engine will read them
                fitted().save(work / GATE_FILE)
            if phase.name in ("disk", "gated"):
                dropped[phase.name] = drop_caches(run.drop_caches)
            with contextlib.closing(phase_job(run, phase, work).events()) as events:  # stops it on errors
                for event in events:
                    if event["event"] == "settled":
                        settles.append({k: event[k] for k in ("tokens", "seconds", "complete")})
                        continue
                    done += 1
                    if event["event"] == "started":
                        engines[phase.name] = event
                        description = f"{phase.name} engine started in {event['seconds']:.0f} s"
                    else:
                        event = check_sample(event, run.block_tokens)
                        if not event["warmup"]:
                            samples.append(event)
                        description = (f"{phase.name}: {event['path']} {event['tokens']:,} tokens, "
                                       f"{event['seconds']:.3f} s")
                    if progress:
                        progress(description, done, total)
        return fitted()
    except JobFailed:
        work = None  # kept: the error names the engine's log in it
        raise
    finally:
        for scratch in scratches:
            shutil.rmtree(scratch, ignore_errors=True)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _read_bandwidth(bench_raw_set: Callable[..., Any], directories: list[Path], size: int) -> float | None:
    """O_DIRECT sequential read GB/s of the medium (``pykv bench``'s raw pass; a device set: all
    devices at once, ``size`` on each), None if not measurable."""
    block = min(4 << 20, max(4096, size - size % 4096))
    if size < block:
        return None
    files = [directory / "bandwidth.dat" for directory in directories]
    try:
        results = bench_raw_set("auto", files, size=size - size % block, block_size=block, depth=16)
    except OSError as exc:
        log.warning("pykv calibrate: cannot measure the read bandwidth of %s: %s",
                    ", ".join(map(str, directories)), exc)
        return None
    finally:
        for file in files:
            file.unlink(missing_ok=True)
    reads = [r for r in results if r.op == "read"]
    return round(reads[0].gb_per_s, 3) if reads else None


def drop_caches(wanted: bool | None) -> str | None:
    """``echo 3 > /proc/sys/vm/drop_caches`` when wanted (None: when root); the outcome, or None if not tried."""
    if wanted is False or (wanted is None and os.geteuid() != 0):
        return None
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as exc:
        return f"not dropped: {exc.strerror}"




def phase_job(run: CalibrationRun, phase: Phase, work: Path) -> EngineJob:
    """The engine process of one phase; its log and events stay in ``work``."""
    stats = str(work / f"{phase.name}.stats")
    env = {**os.environ, COUNTERS_ENV: stats}
    env.setdefault(SEED_ENV, DEFAULT_SEED)  # the store and disk engines must compute the same block keys
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    plan = {"name": phase.name, "engine": phase.engine, "steps": phase.steps, "block_tokens": run.block_tokens,
            "stats": stats}
    return EngineJob(phase.name, ENGINE_MODULE, plan, work, env=env, python=run.python)


def model_label(calibration: Calibration) -> str:
    """The model as it was named (the namespace's label), for titles; ``model`` is its content
    identity (``files:...``). Files from before the label was recorded give the identity."""
    return str(calibration.details.get("model_label") or calibration.model)


def save_labelled_plot(calibration: Calibration, path: str | os.PathLike[str]) -> Path:
    """``pykv.calibration.save_plot`` titled with the model's label instead of its identity."""
    return save_plot(dataclasses.replace(calibration, model=model_label(calibration)), path)
