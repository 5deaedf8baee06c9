"""The engines behind ``pykv calibrate``: measure recompute and hit TTFTs, fit break-even lengths.

``run_calibration(CalibrationRun(...))`` returns a ``pykv.calibration.Calibration``
(the caller saves it). The paper's procedure (§5.2), in three fresh engine
processes (four with ``check_gate``; ``python -m pykv.connector.calibrate
PHASE.json EVENTS.jsonl``), GPU prefix caching off in all of them:

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
   times, each either a full disk load (admitted) or a recompute (refused). The
   calibration's ``gate_check`` compares it per length with the better of
   recompute and disk hit (``ok``: at most ``GATE_TOLERANCE`` times that).

The prompt for length L has L + 1 tokens, so a hit loads exactly L tokens and
computes one; ``max_tokens=1``; TTFT is the wall time of ``LLM.generate``. Every
hit is checked against pykv's worker counters (``PYKV_STATS_FILE``): all L tokens
must come from the tier being measured, or the calibration stops with an error.
The medium's O_DIRECT read bandwidth is measured once with ``pykv.bench``.
Before measuring, each engine runs one unmeasured warm-up request of its kind.
The scratch tree and the work directory are removed at the end, also on errors
and interruptions (the work directory, holding engine logs, stays on errors).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from pykv.calibration import TIERS, Calibration, fit_tiers, median
from pykv.errors import InputError, PykvError

log = logging.getLogger(__name__)

PHASES = ("recompute", "store", "disk", "gated")
GATE_FILE = "gate.json"
"""The gated engine's calibration file, in the work directory (written before that engine starts)."""
GATE_TOLERANCE = 1.05
"""The gated engine may be at most 5 % slower than the better of recompute and disk hit, at every length."""
ENGINE_DEFAULTS: dict[str, Any] = {"skip_tokenizer_init": True, "enforce_eager": True,
                                   "enable_prefix_caching": False, "seed": 0}
"""``LLM(...)`` arguments every calibration engine gets unless ``engine_args`` say otherwise."""
RESERVED_SETTINGS = {"root": "calibration uses a scratch tree under --root",
                     "dram_bytes": "use --dram-bytes", "breakeven_file": "calibration runs without a gate",
                     "breakeven_override": "calibration runs without a gate",
                     "store": "calibration stores the prompts it measures"}
ProgressCallback = Callable[[str, int, int], None]
"""``progress(description, done, total)`` after each engine start and each measured request."""


@dataclass
class CalibrationRun:
    """What to measure and how; ``engine_args`` go to ``vllm.LLM`` as they are."""

    model: str
    root: Path
    lengths: list[int]
    tiers: list[str] = field(default_factory=lambda: list(TIERS))
    repeat: int = 3
    block_tokens: int = 256
    engine_args: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    """Further pykv keys (``kv_connector_extra_config``) for the pykv engines, e.g. ``io_depth``."""
    dram_bytes: int | None = None
    """DRAM tier of the store engine; None: 1.25 x the KV bytes of the longest prompt (from config.json)."""
    bandwidth_bytes: int = 1 << 30
    drop_caches: bool | None = None
    """Drop the page cache before the disk (and gated) engine; None: when running as root."""
    check_gate: bool = False
    """After the disk engine, run each length through an engine gated by the fitted thresholds."""
    python: str = sys.executable

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.lengths:
            raise InputError("--lengths: no lengths to measure")
        if self.repeat < 1:
            raise InputError(f"--repeat: expected a positive integer, got {self.repeat}")
        if self.check_gate and "disk" not in self.tiers:
            raise InputError("--check-gate: needs the disk tier (--tiers disk or disk,dram)")
        for key in self.settings:
            if key in RESERVED_SETTINGS:
                raise InputError(f"--set {key}: not allowed here ({RESERVED_SETTINGS[key]})")
        from pykv.config import PykvConfig
        PykvConfig.from_extra_config({"root": str(self.root), **self.settings})  # raises naming a bad key


@dataclass
class Phase:
    """One engine process: its ``LLM`` arguments and the requests it runs."""

    name: str
    engine: dict[str, Any]
    steps: list[dict[str, Any]]

    @property
    def units(self) -> int:
        return 1 + sum(1 for s in self.steps if s["op"] == "measure")


# -- the plan (pure) -------------------------------------------------------------------------
def prompt_tokens(tokens: int, seed: int) -> list[int]:
    """The prompt whose first ``tokens`` tokens are the measured prefix (plus one computed token)."""
    rng = random.Random(seed * 1_000_003 + tokens)
    return [rng.randrange(3, 1000) for _ in range(tokens + 1)]


def engine_kwargs(run: CalibrationRun) -> dict[str, Any]:
    kwargs = {**ENGINE_DEFAULTS, "model": run.model, "max_model_len": max(run.lengths) + run.block_tokens}
    kwargs.update(run.engine_args)
    return kwargs


def plan_phases(run: CalibrationRun, scratch: Path, work: Path, dram_bytes: int) -> list[Phase]:
    """The engines and requests of a calibration (``dram_bytes``: the store engine's DRAM tier;
    ``work``: the work directory, where the gated engine's calibration file ``GATE_FILE`` will be)."""
    from pykv.config import PykvConfig

    warm = min(run.lengths)
    reps = range(run.repeat)

    def measure(path: str, tokens: int, rep: int, warmup: bool = False, seed: int | None = None) -> dict[str, Any]:
        seed = (1 if warmup else 0) if seed is None else seed
        return {"op": "measure", "path": path, "tokens": tokens, "rep": rep, "seed": seed, "warmup": warmup}

    def pykv(dram: int, **gate: str) -> dict[str, Any]:
        extra = {"root": str(scratch), **run.settings, "dram_bytes": dram, **gate}
        return PykvConfig.from_extra_config(extra).to_kv_transfer_config(run.block_tokens)

    def repeated(path: str, warm_seed: int = 1) -> list[dict[str, Any]]:
        """One unmeasured warm-up request, then each length ``repeat`` times.

        The disk and gated engines warm up on a prompt already stored (``warm_seed`` 0): a fresh
        one would be stored, and that store would still run while the first length is measured.
        """
        return [measure(path, warm, 0, True, warm_seed)] + [measure(path, n, r) for n in run.lengths for r in reps]

    dram = "dram" in run.tiers
    recompute = repeated("recompute")
    store = [measure("cold", warm, 0, True), {"op": "settle", "tokens": warm}]
    store += [measure("dram", warm, 0, True)] if dram else []
    for n in run.lengths:
        store += [measure("cold", n, 0), {"op": "settle", "tokens": n}]
        store += [measure("dram", n, r) for r in reps] if dram else []
    base = engine_kwargs(run)
    phases = [Phase("recompute", base, recompute),
              Phase("store", {**base, "kv_transfer_config": pykv(dram_bytes if dram else 0)}, store)]
    if "disk" in run.tiers:
        phases.append(Phase("disk", {**base, "kv_transfer_config": pykv(0)}, repeated("disk", warm_seed=0)))
    if run.check_gate:
        gated = pykv(0, breakeven_file=str(work / GATE_FILE))
        phases.append(Phase("gated", {**base, "kv_transfer_config": gated}, repeated("gated", warm_seed=0)))
    return phases


def kv_bytes_per_token(model: str, engine_args: dict[str, Any]) -> int | None:
    """KV bytes per token of a Hugging Face model directory (all layers, K and V); None if unknown."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    dtype = str(engine_args.get("kv_cache_dtype", "auto"))
    if dtype.startswith("fp8"):
        width = 1
    else:
        dtype = str(engine_args.get("dtype") or config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        width = 4 if "32" in dtype else 2
    return layers * heads * head_dim * 2 * width


# -- the orchestration ---------------------------------------------------------------------------
def run_calibration(run: CalibrationRun, progress: ProgressCallback | None = None) -> Calibration:
    """Measure, fit and return the calibration; see the module docstring."""
    from pykv.bench import bench_raw
    from pykv.io.probe import direct_io_supported

    per_token = kv_bytes_per_token(run.model, run.engine_args)
    dram_bytes = run.dram_bytes
    if dram_bytes is None and "dram" in run.tiers:
        if per_token is None:
            raise InputError(f"--dram-bytes: cannot size the DRAM tier from {run.model}/config.json; give a size "
                             f"that holds the longest prompt's KV")
        dram_bytes = int(max(run.lengths) * per_token * 1.25) + (64 << 20)
    run.root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pykv-calibrate-"))
    scratch = Path(tempfile.mkdtemp(prefix=".pykv-calibrate-", dir=run.root))
    try:
        phases = plan_phases(run, scratch, work, dram_bytes or 0)
        total = sum(p.units for p in phases) + 1
        done = 0
        if progress:
            progress("measuring the medium's read bandwidth", done, total)
        direct, direct_note = direct_io_supported(scratch)
        bandwidth = _read_bandwidth(bench_raw, scratch, run.bandwidth_bytes) if direct else None
        done += 1
        samples: list[dict[str, Any]] = []
        settles: list[dict[str, Any]] = []  # the store engine's waits for its writes between lengths
        engines: dict[str, dict[str, Any]] = {}
        dropped: dict[str, str | None] = {}  # phase -> page cache outcome before it

        def assemble() -> Calibration:
            return _assemble(run, samples, engines, direct=direct, direct_note=direct_note, bandwidth=bandwidth,
                             dropped=dropped, dram_bytes=dram_bytes, per_token=per_token, settles=settles)

        for phase in phases:
            if phase.name == "gated":  # the thresholds fitted so far, as the gated engine will read them
                assemble().save(work / GATE_FILE)
            if phase.name in ("disk", "gated"):
                dropped[phase.name] = drop_caches(run.drop_caches)
            with contextlib.closing(_run_phase(run, phase, work)) as events:
                for event in events:
                    if event["event"] == "settled":
                        settles.append({k: event[k] for k in ("tokens", "seconds", "complete")})
                        continue
                    done += 1
                    if event["event"] == "started":
                        engines[phase.name] = event
                        description = f"{phase.name} engine started in {event['seconds']:.0f} s"
                    else:
                        event = _check_sample(event, run.block_tokens)
                        if not event["warmup"]:
                            samples.append(event)
                        description = (f"{phase.name}: {event['path']} {event['tokens']:,} tokens, "
                                       f"{event['seconds']:.3f} s")
                    if progress:
                        progress(description, done, total)
        calibration = assemble()
    except KeyboardInterrupt:
        shutil.rmtree(work, ignore_errors=True)  # interrupted on purpose: no logs to keep
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return calibration


def _read_bandwidth(bench_raw: Callable[..., Any], directory: Path, size: int) -> float | None:
    """O_DIRECT sequential read GB/s of the medium (``pykv bench``'s raw pass), None if not measurable."""
    block = min(4 << 20, max(4096, size - size % 4096))
    if size < block:
        return None
    try:
        results = bench_raw("auto", directory / "bandwidth.dat", size=size - size % block, block_size=block, depth=16)
    except OSError as exc:
        log.warning("pykv calibrate: cannot measure the read bandwidth of %s: %s", directory, exc)
        return None
    finally:
        (directory / "bandwidth.dat").unlink(missing_ok=True)
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


def _run_phase(run: CalibrationRun, phase: Phase, work: Path) -> Iterator[dict[str, Any]]:
    """Run one engine process; yield its events as they are written."""
    plan, events, log_path = (work / f"{phase.name}.{suffix}" for suffix in ("plan.json", "events.jsonl", "log"))
    plan.write_text(json.dumps({"name": phase.name, "engine": phase.engine, "steps": phase.steps,
                                "block_tokens": run.block_tokens, "stats": str(work / f"{phase.name}.stats")}))
    env = {**os.environ, "PYKV_STATS_FILE": str(work / f"{phase.name}.stats")}
    env.setdefault("PYTHONHASHSEED", "0")  # the store and disk engines must compute the same block keys
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    with open(log_path, "w") as log_file:  # a file, not a pipe: engine helper processes may outlive the engine
        process = subprocess.Popen([run.python, "-m", "pykv.connector.calibrate", str(plan), str(events)], env=env,
                                   stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    finished = False
    try:
        offset = 0
        while True:
            code = process.poll()
            offset, new = _read_events(events, offset)
            for event in new:
                if event["event"] == "done":
                    finished = True
                else:
                    yield event
            if code is not None:
                break
            time.sleep(0.2)
    finally:
        _stop(process)
    if code != 0 or not finished:
        raise PykvError(f"the {phase.name} engine failed (exit {code}){_last_error(log_path)}; its log is {log_path}")


def _read_events(path: Path, offset: int) -> tuple[int, list[dict[str, Any]]]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset, []
    complete = data[:data.rfind(b"\n") + 1]
    return offset + len(complete), [json.loads(line) for line in complete.splitlines() if line.strip()]


def _stop(process: subprocess.Popen) -> None:
    """End the engine process and what is left of its process group (its own session, started here):
    vLLM's engine-core and worker processes can outlive the runner that started them."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # nothing left in the group
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(process.pid):
            process.poll()
            time.sleep(0.1)
        if not _group_alive(process.pid):
            break
    process.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(_is_running(pid) for pid in _group_members(pgid))


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie holds nothing


_ERROR_LINE = re.compile(r"\b([A-Za-z_]*(?:Error|Exception)): (.*)$")
_GENERIC = ("Engine core initialization failed", "EngineDeadError", "See root cause above")


def _last_error(log_path: Path) -> str:
    """The most telling exception line of an engine log: the last one that is not vLLM's generic wrapper."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [f"{m.group(1)}: {m.group(2).strip()}" for m in map(_ERROR_LINE.search, lines) if m]
    specific = [e for e in errors if not any(g in e for g in _GENERIC)]
    chosen = (specific or errors)[-1:]
    return f": {chosen[0][:400]}" if chosen else ""


def _check_sample(event: dict[str, Any], block_tokens: int) -> dict[str, Any]:
    """A hit must have loaded all its tokens from the tier measured; a recompute nothing; a gated
    run either all from disk or nothing. Returns the sample, a gated one with ``admitted``."""
    path, tokens, cached = event["path"], event["tokens"], event["cached_tokens"]
    loaded = event.get("loaded", {})
    if path in ("recompute", "cold"):
        if cached:
            raise PykvError(f"{path} run at {tokens:,} tokens reused {cached} tokens; GPU prefix caching must be off "
                            f"(do not pass enable_prefix_caching=true)")
        return event
    tier = "disk" if path == "gated" else path
    other = "disk" if tier == "dram" else "dram"
    full = cached == tokens and loaded.get(tier, 0) == tokens // block_tokens and not loaded.get(other, 0)
    if path == "gated":
        if not full and (cached or any(loaded.values())):
            raise PykvError(f"gated run at {tokens:,} tokens {_loads(cached, loaded)}; expected all from disk "
                            f"(admitted) or none (refused)")
        return {**event, "admitted": full}
    if not full:
        hint = " (raise --dram-bytes)" if path == "dram" else ""
        raise PykvError(f"{path} hit at {tokens:,} tokens {_loads(cached, loaded)}; expected all from {path}{hint}")
    return event


def _loads(cached: int, loaded: dict[str, int]) -> str:
    return f"loaded {cached} tokens ({loaded.get('disk', 0)} blocks from disk, {loaded.get('dram', 0)} from DRAM)"


def summarize_gate(samples: list[dict[str, Any]], tolerance: float = GATE_TOLERANCE) -> dict[str, Any] | None:
    """Per length, the gated engine's median TTFT against the better of recompute and disk hit
    (medians as fitted; ``ok``: at most ``tolerance`` times the better); None without gated samples."""
    gated: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        if sample["path"] == "gated":
            gated.setdefault(int(sample["tokens"]), []).append(sample)
    if not gated:
        return None
    disk = {p["tokens"]: p for p in fit_tiers(samples, ["disk"])[0]["disk"].points}
    points = [_gate_point(tokens, runs, disk[tokens]["recompute_s"], disk[tokens]["hit_s"], tolerance)
              for tokens, runs in sorted(gated.items())]
    return {"tolerance": tolerance, "points": points, "max_ratio": max(p["ratio"] for p in points),
            "all_ok": all(p["ok"] for p in points), "all_right": all(p["right"] for p in points)}


def _gate_point(tokens: int, runs: list[dict[str, Any]], recompute_s: float, disk_s: float,
                tolerance: float) -> dict[str, Any]:
    """One length of ``gate_check``; ``admitted``: how many of the gated runs loaded (the rest recomputed).

    ``ok``: the gated median is at most ``tolerance`` times the better path (time, all costs
    included). ``right``: every run took a path whose own median, measured in the recompute and
    disk engines, is at most ``tolerance`` times the better one (the decision alone).
    """
    seconds = [float(run["seconds"]) for run in runs]
    gated_s, best_s = median(seconds), min(recompute_s, disk_s)
    ratio = gated_s / best_s
    admitted = sum(1 for run in runs if run["admitted"])
    chosen = ([disk_s] if admitted else []) + ([recompute_s] if admitted < len(runs) else [])
    return {"tokens": tokens, "gated_s": round(gated_s, 6), "recompute_s": recompute_s, "disk_s": disk_s,
            "best_s": best_s, "ratio": round(ratio, 4), "admitted": admitted, "runs": len(runs),
            "ok": ratio <= tolerance, "right": all(c <= tolerance * best_s for c in chosen),
            "gated_samples": seconds}


def _assemble(run: CalibrationRun, samples: list[dict[str, Any]], engines: dict[str, dict[str, Any]], *,
              direct: bool, direct_note: str, bandwidth: float | None, dropped: dict[str, str | None],
              dram_bytes: int | None, per_token: int | None, settles: Sequence[dict[str, Any]]) -> Calibration:
    """The calibration of the samples so far (``dropped``: phase -> page cache outcome before it)."""
    store = engines["store"]["engine"]
    namespace = store.get("namespace") or {}
    if not namespace:
        raise PykvError("the store engine created no namespace in the scratch tree; is pykv loaded?")
    page_cache = "bypassed (O_DIRECT reads)" if direct else "not bypassed (buffered reads)"
    page_cache += "".join(f"; {outcome} before the {name} engine" for name, outcome in dropped.items() if outcome)
    if not direct and dropped.get("disk") != "dropped" and "disk" in run.tiers:
        log.warning("pykv: disk hits may have come from the page cache (%s; caches %s)", direct_note,
                    dropped.get("disk") or "not dropped: not root")
    tiers, recompute, cold = fit_tiers(samples, run.tiers)
    details = {
        "storage_block_tokens": run.block_tokens,
        "kv_bytes_per_token": per_token,
        "method": {"repeat": run.repeat, "statistic": "median", "max_tokens": 1,
                   "prompt": "L + 1 random tokens; a hit loads L tokens and computes 1",
                   "ttft": "wall time of LLM.generate for one request",
                   "recompute": "engine without connector, GPU prefix caching off",
                   "cold": "first run in the store engine: prefill + store (not used for the fit)",
                   "dram": f"second and later runs in the store engine, DRAM tier {dram_bytes or 0} bytes",
                   "disk": "fresh engine without DRAM tier on the same tree",
                   **({"gated": "fresh engine like disk, break-even gate from the tiers fitted here"}
                      if run.check_gate else {}),
                   "fit": "piecewise-linear gain recompute_s - hit_s; last crossing from negative to >= 0",
                   "engine_start_s": {name: e["seconds"] for name, e in engines.items()}},
        "engine_args": run.engine_args,
        "pykv_settings": run.settings,
        "recompute": {"points": recompute},
        "cold": {"points": cold},
        "store_settle": list(settles),
    }
    gate_check = summarize_gate(samples)
    if gate_check is not None:
        details["gate_check"] = gate_check
    return Calibration(model=namespace["model"], dtype=namespace["dtype"], kv_layout=namespace["kv_layout"],
                       tiers=tiers, namespace=namespace.get("id"), gpu=store.get("gpu", ""),
                       vllm_version=store.get("vllm_version", ""),
                       medium={"path": str(run.root), "read_gb_per_s": bandwidth, "direct_io": direct,
                               "page_cache": page_cache},
                       details=details)


# -- inside the engine process -------------------------------------------------------------------
def _describe_engine(root: str | None) -> dict[str, Any]:
    from pykv.connector.compat import VLLM_VERSION, current_platform
    from pykv.io.safe_paths import read_small

    from pykv.tree import NAMESPACE_FILE, KVTree

    try:
        gpu = current_platform.get_device_name(0)
    except Exception:  # noqa: BLE001 - a name is nice to have
        gpu = "unknown"
    if gpu == "cpu":
        gpu = "cpu: " + next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                              if line.startswith("model name")), "unknown")
    info: dict[str, Any] = {"vllm_version": VLLM_VERSION, "gpu": gpu}
    if root:
        for directory in KVTree.open(root).namespaces():
            data = json.loads(read_small(directory / NAMESPACE_FILE))
            if str(data.get("extra", {}).get("rank", "0")) == "0":
                info["namespace"] = data
    return info


def _worker_loads(stats: str) -> dict[str, int]:
    from pykv.connector.demo import read_counters
    worker = read_counters(stats).get("worker0", {})
    return {tier: int(worker.get(f"load_blocks_{tier}", 0)) for tier in TIERS}


def _settle(stats: str, timeout: float) -> bool:
    """Wait until the store engine's stores are published and committed (nothing pending, no
    change); False if they were still pending after ``timeout`` seconds."""
    from pykv.connector.demo import read_counters
    deadline, previous = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        counters = read_counters(stats)
        busy = counters.get("scheduler", {}).get("pending_stores", 0) or any(
            v.get("jobs_in_flight", 0) for k, v in counters.items() if k.startswith("worker"))
        if counters and not busy and counters == previous:
            return True
        previous = counters
        time.sleep(0.3)
    log.warning("pykv calibrate: stores still pending after %.0f s", timeout)
    return False


def engine_main(plan_path: str, events_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    from pykv.connector.compat import LLM, SamplingParams

    out = open(events_path, "a", buffering=1)

    def emit(**event: Any) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()

    started = time.perf_counter()
    llm = LLM(**plan["engine"])
    root = (plan["engine"].get("kv_transfer_config") or {}).get("kv_connector_extra_config", {}).get("root")
    emit(event="started", seconds=round(time.perf_counter() - started, 2), engine=_describe_engine(root))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    stats, block_tokens = plan["stats"], plan["block_tokens"]
    for step in plan["steps"]:
        if step["op"] == "settle":
            began = time.perf_counter()
            complete = _settle(stats, timeout=60 + step["tokens"] / 1000)
            emit(event="settled", tokens=step["tokens"], seconds=round(time.perf_counter() - began, 3),
                 complete=complete)
            continue
        prompt = {"prompt_token_ids": prompt_tokens(step["tokens"], step["seed"])}
        before = _worker_loads(stats) if root else {}
        began = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - began
        cached = int(output.num_cached_tokens or 0)
        loaded: dict[str, int] = {}
        if root:
            deadline = time.monotonic() + 5  # the worker writes its counters a moment after the load
            while True:
                after = _worker_loads(stats)
                loaded = {tier: after[tier] - before.get(tier, 0) for tier in TIERS}
                if sum(loaded.values()) >= cached // block_tokens or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        emit(event="sample", path=step["path"], tokens=step["tokens"], rep=step["rep"], warmup=step["warmup"],
             seconds=round(seconds, 6), cached_tokens=cached, loaded=loaded)
    emit(event="done")
    out.close()
    from pykv.connector import compat
    compat.shutdown_engine(llm)  # stop the engine-core processes now rather than leave them to the caller


if __name__ == "__main__":
    engine_main(sys.argv[1], sys.argv[2])
    os._exit(0)  # skip the slow teardown of the engine's threads
