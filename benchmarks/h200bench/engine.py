"""One engine process: a vLLM engine, a list of steps (fill, query, tokens, settle, drop_caches), JSON lines out.

``h200_connector.py engine CONFIG.json`` runs it; the runner writes the config
(``runner.Runner.engine``). pykv runs as stock ``PykvSpec``; its counters come from the
counter files (``PYKV_STATS_FILE``, ``stats.read_stats``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from h200bench import diskstats
from h200bench.settings import CHUNK, WARMUP_TOKENS
from h200bench.stats import RECORDED, busy, load_job_fields, rank_deltas, read_stats, worker_counters
from h200bench.util import doc_tokens, drop_caches, emit, expected_chunks, log, wait_files


def engine_main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    results = cfg["results"]
    tags = {k: cfg.get(k) for k in ("stage", "label", "system", "medium", "variant")}
    stats_base = cfg.get("stats")
    if stats_base:
        os.environ["PYKV_STATS_FILE"] = stats_base

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(cfg["engine_kwargs"])
    if cfg.get("ktc"):
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(**cfg["ktc"])
    t0 = time.perf_counter()
    llm = LLM(**kw)
    emit(results, {"kind": "engine", **tags, "start_s": round(time.perf_counter() - t0, 1)})
    vocab = cfg["vocab"]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def generate(tokens: list[int], params=sp):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return time.perf_counter() - t, getattr(out[0], "num_cached_tokens", None), out[0]

    generate([1] * WARMUP_TOKENS)  # warm-up (not recorded)
    time.sleep(1.0)
    kick_rng = random.Random(7)

    def kick() -> None:  # a tiny request keeps the engine stepping (no full chunk: stores nothing)
        generate([kick_rng.randrange(vocab) for _ in range(16)])

    def settle(timeout: float) -> dict:
        """Wait until pykv has no transfer in flight and its counters stop changing."""
        deadline = time.monotonic() + timeout
        previous, unchanged_since = None, time.monotonic()
        while time.monotonic() < deadline:
            stats = read_stats(stats_base)
            if stats and not busy(stats) and stats == previous:
                return stats
            if stats != previous:
                previous, unchanged_since = stats, time.monotonic()
            elif time.monotonic() - unchanged_since > 10:
                kick()
                unchanged_since = time.monotonic()
            time.sleep(0.5)
        log(f"settle: still busy after {timeout:.0f} s")
        return read_stats(stats_base)

    extra = (cfg.get("ktc") or {}).get("kv_connector_extra_config") or {}
    disks = diskstats.stat_paths(list(extra.get("roots") or ([extra["root"]] if extra.get("root") else [])))

    def measured(tokens: list[int], step: dict, *, settle_first: bool, params=sp):
        """One request with pykv's counters around it (settled first when asked): (seconds, cached
        tokens, the output, the record's counter fields, with ``disks``: each device's reads and
        busy time during the request)."""
        if stats_base and settle_first:
            settle(60)
        before, disks_before = read_stats(stats_base), diskstats.snapshot(disks)
        began_ns = time.time_ns()
        seconds, cached, out = generate(tokens, params)
        window = (began_ns, time.time_ns())
        disk_fields = diskstats.delta(disks_before, diskstats.snapshot(disks))
        time.sleep(step.get("pause", 1.0))  # deferred stores / stats catch up
        fields = counter_fields(before, read_stats(stats_base), window=window) if stats_base else {}
        if disk_fields:
            fields["disks"] = disk_fields
        return seconds, cached, out, fields

    for step in cfg["steps"]:
        op = step["op"]
        if op in ("fill", "query"):
            for length in cfg["lengths"]:
                for doc in range(cfg["docs"]):
                    tokens = doc_tokens(length, doc, vocab)
                    for phase in step.get("phases", [op]):
                        ttft, cached, _, counters = measured(tokens, step, settle_first=op == "query")
                        rec = {"kind": "ttft", **tags, "phase": phase, "length": length, "doc": doc,
                               "ttft": round(ttft, 4), "cached": cached,
                               "expected_cached": expected_chunks(length) * CHUNK,
                               "kv_bytes": (cached or 0) * cfg["kv_bytes_per_token"]}
                        if op == "query" and cached:
                            rec["e2e_gb_per_s"] = round(cached * cfg["kv_bytes_per_token"] / ttft / 1e9, 3)
                        emit(results, {**rec, **counters})
        elif op == "tokens":  # greedy output tokens of one document, ``repeat`` times (output equality)
            tokens = doc_tokens(step["length"], step.get("doc", 0), vocab)
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, detokenize=False)
            for run in range(step.get("repeat", 1)):
                seconds, cached, out, counters = measured(tokens, step, settle_first=True, params=params)
                emit(results, {"kind": "tokens", **tags, "phase": step.get("phase", "tokens"), "length": step["length"],
                               "doc": step.get("doc", 0), "run": run, "seconds": round(seconds, 4), "cached": cached,
                               "tokens": list(out.outputs[0].token_ids), **counters})
        elif op == "settle":
            t = time.perf_counter()
            if stats_base:
                stats = settle(step.get("timeout", 300))
                counters = worker_counters(stats)
                emit(results, {"kind": "fill_summary", **tags, "settle_s": round(time.perf_counter() - t, 1),
                               "store_published": counters.get("store_published", 0),
                               "store_blocks": counters.get("store_blocks", 0),
                               "store_blocks_failed": counters.get("store_blocks_failed", 0),
                               "scheduler": stats.get("scheduler", {})})
            elif step.get("files_root"):
                n = wait_files(step["files_root"], step.get("files_suffix", ".bin"), step["files_expected"],
                               step.get("timeout", 300))
                emit(results, {"kind": "fill_summary", **tags, "settle_s": round(time.perf_counter() - t, 1),
                               "files": n, "files_expected": step["files_expected"]})
            else:
                time.sleep(step.get("seconds", 2.0))
        elif op == "drop_caches":  # between steps of one engine (stage LM: a query in the engine that filled)
            emit(results, {"kind": "drop_caches", **tags, "ok": drop_caches()})
        else:
            raise ValueError(f"unknown step {op!r}")

    try:  # graceful: the worker drains and unregisters its memory, the GPU is freed
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001
        log(f"engine shutdown: {exc!r}")
    sys.stdout.flush()
    os._exit(0)


GAUGES = ("staging_bytes", "staging_huge_bytes")
"""Worker counters a TTFT record carries as values: the staging pool and its share on huge pages."""

TIMELINE = (("survey_began", "scheduler", "survey_began_ns"), ("survey_ended", "scheduler", "survey_ended_ns"),
            ("load_planned", "scheduler", "load_planned_ns"), ("load_submitted", "worker", "load_submitted_ns"),
            ("load_ended", "worker", "load_ended_ns"), ("load_reported", "worker", "load_reported_ns"))
"""(name, process, wall-clock gauge) of the steps of a request's load, in their order."""


def timeline(stats: dict, window: tuple[int, int]) -> dict[str, float]:
    """Each ``TIMELINE`` step that fell inside ``window`` (the request's wall-clock nanoseconds), in
    ms from its start (a worker step: the latest rank's), and ``first_token`` at the window's end."""
    began, ended = window
    steps: dict[str, float] = {}
    for name, process, gauge in TIMELINE:
        at = max((c[gauge] for role, c in stats.items() if role.startswith(process) and gauge in c), default=None)
        if at is not None and began <= at <= ended:
            steps[name] = round((at - began) / 1e6, 2)
    if steps:
        steps["first_token"] = round((ended - began) / 1e6, 2)
    return steps


def counter_fields(stats_before: dict, stats_after: dict, *, window: tuple[int, int] | None = None) -> dict:
    """A TTFT record's counter fields: the recorded worker deltas (summed over ranks, and per rank
    when there are several), every changed worker and scheduler counter, and pykv's load seconds
    and bandwidth; with ``window`` (the request's wall-clock span), its load's ``timeline``."""
    before, after = worker_counters(stats_before), worker_counters(stats_after)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before) if not k.endswith("_ns")}
    fields: dict = {str(key): delta.get(key, 0) for key in RECORDED}
    fields["worker_delta"] = {k: v for k, v in sorted(delta.items()) if v}
    sb, sa = stats_before.get("scheduler", {}), stats_after.get("scheduler", {})
    fields["scheduler_delta"] = {k: sa[k] - sb.get(k, 0) for k in sorted(sa)
                                 if sa[k] != sb.get(k, 0) and not k.endswith("_ns")}
    steps = timeline(stats_after, window) if window else {}
    if steps:
        fields["timeline"] = steps
    ranks = rank_deltas(stats_before, stats_after)
    if len(ranks) > 1:
        fields["per_rank"] = ranks
    for gauge in GAUGES:  # set once at start: their values, not deltas
        if gauge in after:
            fields[gauge] = after[gauge]
    _, nbytes, us = load_job_fields(fields)
    if us > 0:
        fields["load_seconds"] = round(us / 1e6, 4)
        fields["load_gb_per_s"] = round(nbytes / (us / 1e6) / 1e9, 3)
    return fields
