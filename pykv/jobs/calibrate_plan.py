"""What a calibration measures: ``CalibrationRun`` (the options) and its engines' plan (pure).

``plan_phases`` turns a run into ``Phase`` objects, one per engine process, each with
the ``LLM`` arguments and the requests it runs (``pykv.jobs.calibrate`` describes the
procedure). Imports neither vLLM nor torch.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pykv.calibration import TIERS
from pykv.config import root_keys
from pykv.deviceset import require_roots
from pykv.errors import InputError
from pykv.jobs.model_limit import ModelLimit, engine_limit, fit_lengths, model_config, text_config

PHASES = ("recompute", "store", "disk", "gated")
GATE_FILE = "gate.json"
"""The gated engine's calibration file, in the work directory (written before that engine starts)."""
GATE_TOLERANCE = 1.05
"""The gated engine may be at most 5 % slower than the better of recompute and disk hit, at every length."""
MISS_SEED = 2
"""The seed of the gated engine's miss prompts: no engine stores a prompt of this seed, so each misses."""
ENGINE_DEFAULTS: dict[str, Any] = {"skip_tokenizer_init": True, "enforce_eager": True,
                                   "enable_prefix_caching": False, "seed": 0}
"""``LLM(...)`` arguments every calibration engine gets unless ``engine_args`` say otherwise."""
RESERVED_SETTINGS = {"root": "calibration uses a scratch tree under --root",
                     "roots": "calibration uses a scratch tree under each --root",
                     "dram_bytes": "use --dram-bytes", "breakeven_file": "calibration runs without a gate",
                     "breakeven_override": "calibration runs without a gate",
                     "store": "calibration stores the prompts it measures"}


@dataclass
class CalibrationRun:
    """What to measure and how; ``engine_args`` go to ``vllm.LLM`` as they are."""

    model: str
    root: Path  # the medium's directory; with ``roots``, the first of them
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
    roots: list[Path] = field(default_factory=list)
    """A device set: one directory per device (each must exist); the scratch tree is a set of one per device."""
    default_lengths: bool = False
    """``lengths`` are the command's defaults: those longer than the model takes are dropped (see ``notes``)
    instead of refused."""
    model_limit: ModelLimit | None = field(default=None, init=False)
    """The engines' longest sequence, from the model's config.json or ``engine_args``; None if unknown."""
    notes: list[str] = field(default_factory=list, init=False)
    """What validation changed (dropped default lengths), for the caller to show."""

    @property
    def root_paths(self) -> list[Path]:
        return list(self.roots) or [self.root]

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.roots = [Path(root) for root in self.roots]
        require_roots(self.root_paths, field="--root")  # the one rule: every root exists, none is made
        if not self.lengths:
            raise InputError("--lengths: no lengths to measure")
        self.model_limit = engine_limit(self.model, self.engine_args)  # vLLM says it only once an engine runs
        self.lengths, note = fit_lengths(self.lengths, self.model_limit, self.block_tokens,
                                         defaults=self.default_lengths)
        self.notes = [note] if note else []
        if self.repeat < 1:
            raise InputError(f"--repeat: expected a positive integer, got {self.repeat}")
        if self.check_gate and "disk" not in self.tiers:
            raise InputError("--check-gate: needs the disk tier (--tiers disk or disk,dram)")
        for key in self.settings:
            if key in RESERVED_SETTINGS:
                raise InputError(f"--set {key}: not allowed here ({RESERVED_SETTINGS[key]})")
        from pykv.config import PykvConfig
        PykvConfig.from_extra_config({**scratch_roots(self.root_paths), **self.settings})  # raises naming a bad key


@dataclass
class Phase:
    """One engine process: its ``LLM`` arguments and the requests it runs."""

    name: str
    engine: dict[str, Any]
    steps: list[dict[str, Any]]

    @property
    def units(self) -> int:
        return 1 + sum(1 for s in self.steps if s["op"] == "measure")


# -- the plan ------------------------------------------------------------------------------------
def prompt_tokens(tokens: int, seed: int) -> list[int]:
    """The prompt whose first ``tokens`` tokens are the measured prefix (plus one computed token)."""
    rng = random.Random(seed * 1_000_003 + tokens)
    return [rng.randrange(3, 1000) for _ in range(tokens + 1)]


def engine_kwargs(run: CalibrationRun) -> dict[str, Any]:
    longest = max(run.lengths) + run.block_tokens
    if run.model_limit is not None:  # the lengths fit it (``fit_lengths``); one block more may not
        longest = min(longest, run.model_limit.tokens)
    kwargs = {**ENGINE_DEFAULTS, "model": run.model, "max_model_len": longest}
    kwargs.update(run.engine_args)
    return kwargs


def scratch_roots(scratch: Path | list[Path]) -> dict[str, Any]:
    """The pykv key for the scratch tree: ``root``, or ``roots`` for one per device."""
    paths = scratch if isinstance(scratch, list) else [scratch]
    return root_keys(paths)


def plan_phases(run: CalibrationRun, scratch: Path | list[Path], work: Path, dram_bytes: int) -> list[Phase]:
    """The engines and requests of a calibration (``scratch``: the scratch tree's directory, a list
    for a device set; ``dram_bytes``: the store engine's DRAM tier; ``work``: the work directory,
    where the gated engine's calibration file ``GATE_FILE`` will be)."""
    from pykv.config import PykvConfig

    warm = min(run.lengths)
    reps = range(run.repeat)

    def measure(path: str, tokens: int, rep: int, warmup: bool = False, seed: int | None = None) -> dict[str, Any]:
        seed = (1 if warmup else 0) if seed is None else seed
        return {"op": "measure", "path": path, "tokens": tokens, "rep": rep, "seed": seed, "warmup": warmup}

    def pykv(dram: int, **gate: Any) -> dict[str, Any]:
        extra = {**scratch_roots(scratch), **run.settings, "dram_bytes": dram, **gate}
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
    if run.check_gate:  # stores off: the miss prompts stay misses, and nothing writes behind a sample
        gated = pykv(0, breakeven_file=str(work / GATE_FILE), store=False)
        steps = [measure("gated", warm, 0, True, 0)]
        for n in run.lengths:  # a length's first run pays one-time costs: an unmeasured miss, then the two in turn
            steps.append(measure("miss", n, 0, True, MISS_SEED))
            for r in reps:
                steps += [measure("gated", n, r), measure("miss", n, r, seed=MISS_SEED)]
        phases.append(Phase("gated", {**base, "kv_transfer_config": gated}, steps))
    return phases


def kv_bytes_per_token(model: str, engine_args: dict[str, Any]) -> int | None:
    """KV bytes per token of a Hugging Face model directory (all layers, K and V); None if unknown."""
    config = model_config(model)
    if config is None:
        return None
    config = text_config(config)
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


