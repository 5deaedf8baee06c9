"""A calibration's samples checked and summed up: ``check_sample``, ``summarize_gate``, ``assemble``. Pure."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from pykv.calibration import Calibration, fit_tiers, median
from pykv.errors import PykvError
from pykv.jobs.calibrate_plan import GATE_TOLERANCE, CalibrationRun

log = logging.getLogger(__name__)


def check_sample(event: dict[str, Any], block_tokens: int) -> dict[str, Any]:
    """A hit must have loaded all its tokens from the tier measured; a recompute nothing; a gated
    run either all from disk or nothing. Returns the sample, a gated one with ``admitted``."""
    path, tokens, cached = event["path"], event["tokens"], event["cached_tokens"]
    loaded = event.get("loaded", {})
    if path == "miss":
        if cached or any(loaded.values()):
            raise PykvError(f"miss run at {tokens:,} tokens {_loads(cached, loaded)}; expected nothing (a prompt "
                            f"no engine stored)")
        return event
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
    """Per length, the gated engine's median TTFT against the better path (``_gate_point``; ``ok``: at
    most ``tolerance`` times it); None without gated samples."""
    gated: dict[int, list[dict[str, Any]]] = {}
    misses: dict[int, list[float]] = {}
    for sample in samples:
        if sample["path"] == "gated":
            gated.setdefault(int(sample["tokens"]), []).append(sample)
        elif sample["path"] == "miss":
            misses.setdefault(int(sample["tokens"]), []).append(float(sample["seconds"]))
    if not gated:
        return None
    disk = {p["tokens"]: p for p in fit_tiers(samples, ["disk"])[0]["disk"].points}
    points = [_gate_point(tokens, runs, disk[tokens]["recompute_s"], disk[tokens]["hit_s"], tolerance,
                          misses.get(tokens, []))
              for tokens, runs in sorted(gated.items())]
    return {"tolerance": tolerance, "points": points, "max_ratio": max(p["ratio"] for p in points),
            "all_ok": all(p["ok"] for p in points), "all_right": all(p["right"] for p in points)}


def _gate_point(tokens: int, runs: list[dict[str, Any]], recompute_s: float, disk_s: float,
                tolerance: float, misses: list[float]) -> dict[str, Any]:
    """One length of ``gate_check``; ``admitted``: how many of the gated runs loaded (the rest recomputed).

    ``best_s``: the better path. With ``misses`` each path is measured in the gated engine where it
    ran there (recompute: its misses, prompts no engine stored; disk: its admitted runs less the
    gate's decision time), else in the disk engine - fresh engines differ from each other by more
    than 5 % on the same path at short lengths; without, in the recompute and disk engines.
    ``ok``: the gated median is at most ``tolerance`` times ``best_s``; ``ratio_engines``: the
    gated median against the recompute and disk engines alone. ``right``:
    every run took a path whose own median, in the recompute and disk engines, is at most
    ``tolerance`` times the better one (the decision alone). ``gate_s`` / ``gate_share``: the gate's
    own decision time (median) and its share of the better path, where the counters gave it.
    """
    seconds = [float(run["seconds"]) for run in runs]
    loads = [float(run["seconds"]) for run in runs if run["admitted"]]
    gate_us = [int(run["gate_us"]) for run in runs if "gate_us" in run]
    gate_s = median(gate_us) / 1e6 if gate_us else 0.0
    gated_s, engines_best = median(seconds), min(recompute_s, disk_s)
    best_s = engines_best
    if misses:
        load_s = disk_s
        if loads:  # its own loads less the gate's decision (at most half of them): that path without the gate
            load_s = median(loads) - min(gate_s, median(loads) / 2)
        best_s = min(median(misses), load_s)
    ratio = gated_s / best_s
    admitted = len(loads)
    chosen = ([disk_s] if admitted else []) + ([recompute_s] if admitted < len(runs) else [])
    return {"tokens": tokens, "gated_s": round(gated_s, 6), "recompute_s": recompute_s, "disk_s": disk_s,
            **({"miss_s": round(median(misses), 6), "miss_samples": misses} if misses else {}),
            "best_s": best_s, "ratio": round(ratio, 4), "ratio_engines": round(gated_s / engines_best, 4),
            "admitted": admitted, "runs": len(runs), "ok": ratio <= tolerance,
            "right": all(c <= tolerance * engines_best for c in chosen), "gated_samples": seconds,
            **({"gate_s": gate_s, "gate_share": round(gate_s / best_s, 6)} if gate_us else {})}


def assemble(run: CalibrationRun, samples: list[dict[str, Any]], engines: dict[str, dict[str, Any]], *,
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
        "model_label": namespace.get("label") or run.model,  # the model as named; ``model`` is its identity
        "storage_block_tokens": run.block_tokens,
        "kv_bytes_per_token": per_token,
        "method": {"repeat": run.repeat, "statistic": "median", "max_tokens": 1,
                   "prompt": "L + 1 random tokens; a hit loads L tokens and computes 1",
                   "ttft": "wall time of LLM.generate for one request",
                   "recompute": "engine without connector, GPU prefix caching off",
                   "cold": "first run in the store engine: prefill + store (not used for the fit)",
                   "dram": f"second and later runs in the store engine, DRAM tier {dram_bytes or 0} bytes",
                   "disk": "fresh engine without DRAM tier on the same tree",
                   **({"gated": "fresh engine like disk, break-even gate from the tiers fitted here, stores off",
                       "miss": "in the gated engine: prompts no engine stored (recompute with pykv present)",
                       "gate_check": "gated median against the better path, measured in the gated engine where "
                                     "it ran that path (misses, its own loads), else in the recompute or disk "
                                     "engine; ratio_engines: against those engines alone"}
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
    codec = (namespace.get("extra") or {}).get("codec", "none")
    return Calibration(model=namespace["model"], dtype=namespace["dtype"], kv_layout=namespace["kv_layout"], codec=codec,
                       tiers=tiers, namespace=namespace.get("id"), gpu=store.get("gpu", ""),
                       vllm_version=store.get("vllm_version", ""),
                       medium={"path": str(run.root), "read_gb_per_s": bandwidth, "direct_io": direct,
                               "page_cache": page_cache,
                               **({"devices": [str(root) for root in run.roots]} if len(run.roots) > 1 else {})},
                       details=details)


