"""The floor of a preloading burst (issue 19): the mean TTFT that no cache could beat on this host.

The burst admits its requests in order, at most ``concurrency`` in flight. A miss needs the GPU for
one cold prefill of its length (the fill engine's TTFT, same lease); a hit needs its document read
from the medium the first time (O_DIRECT rate, same lease) and from DRAM after that (the H2D rate
when the lease measured it, else free). The GPU and the medium each serve one request at a time
and work in parallel; nothing else costs time. The simulated mean TTFT of that schedule is the
floor; its busy span is the floor wall, max(GPU prefill of the misses, medium read of the hits).

The in-order floor adds one rule of stock vLLM: a request is scheduled in arrival order, so a hit
whose KV is ready still waits until the misses admitted before it are through the GPU (at no GPU
cost of its own). A connector cannot reorder vLLM's queue; this is the floor a cache can reach."""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass

from h200bench.multibw import AGG_WHAT
from h200bench.preload_workload import burst_docs


@dataclass(frozen=True)
class Floor:
    prefill_s: float        # one cold prefill of the burst's length
    read_gb_per_s: float    # the medium's O_DIRECT read rate
    h2d_gb_per_s: float | None
    mean_s: float           # the floor of the burst's mean TTFT
    wall_s: float           # the floor of the burst's wall time
    read_source: str        # which measurement gave read_gb_per_s
    in_order_mean_s: float  # the same with hits served in vLLM's arrival order


def simulate(hits: list[int | None], concurrency: int, prefill_s: float, first_read_s: float,
             dram_read_s: float, *, in_order: bool = False) -> tuple[float, float]:
    """Mean TTFT and busy span of the ideal schedule. ``hits[i]`` is request i's document, or None
    for a miss; a document's first hit costs ``first_read_s`` on the medium, later ones ``dram_read_s``;
    ``in_order``: a hit also waits for the GPU to finish the requests admitted before it."""
    in_flight: list[float] = []
    gpu_free = medium_free = now = 0.0
    seen: set[int] = set()
    total = 0.0
    for doc in hits:
        if len(in_flight) >= concurrency:
            now = max(now, heapq.heappop(in_flight))
        if doc is None:
            gpu_free = max(now, gpu_free) + prefill_s
            done = gpu_free
        else:
            cost = dram_read_s if doc in seen else first_read_s
            seen.add(doc)
            medium_free = max(now, medium_free) + cost
            done = medium_free
            if in_order:
                done = max(done, gpu_free)
        total += done - now
        heapq.heappush(in_flight, done)
    return (total / len(hits) if hits else 0.0), max(gpu_free, medium_free)


def best_rate(records: list[dict], what: str, **match) -> float | None:
    """The highest ``gb_per_s`` of the ``bw`` records of ``what`` whose fields equal ``match``."""
    rates = [r["gb_per_s"] for r in records if r.get("kind") == "bw" and r.get("what") == what and r.get("gb_per_s")
             and all(r.get(k) == v for k, v in match.items())]
    return max(rates) if rates else None


def medium_rate(records: list[dict], stage: str) -> tuple[float, str] | None:
    """The O_DIRECT read rate of one loop device: the stage's own probe, else the lease's best
    one-device pass of stage S1 (the same kind of device)."""
    own = best_rate(records, "odirect_read", stage=stage)
    if own:
        return own, f"{stage}'s own O_DIRECT probe"
    one = best_rate(records, AGG_WHAT, devices=1)
    if one:
        return one, "S1's one-device O_DIRECT probe in the same lease"
    return None


def lease_kv_bytes_per_token(records: list[dict]) -> int | None:
    """KV bytes per token from a disk hit of the lease (burst records before run 12 lack it; the
    lease runs one model shape)."""
    for r in records:
        if r.get("kind") == "ttft" and r.get("cached") and r.get("kv_bytes"):
            return r["kv_bytes"] // r["cached"]
    return None


def burst_floor(burst: dict, records: list[dict]) -> Floor | None:
    """The floor of ``burst`` (a ``burst`` record) from the measurements in ``records``, or None when
    the lease lacks the fill's prefill time, the medium's rate or the burst's KV size."""
    fills = [r["ttft"] for r in records if r.get("kind") == "ttft" and r.get("phase") == "fill"
             and r.get("stage") == burst["stage"] and r.get("length") == burst["length"]]
    rate = medium_rate(records, burst["stage"])
    kv = burst.get("kv_bytes_per_token") or lease_kv_bytes_per_token(records)
    if not fills or rate is None or not kv:
        return None
    doc_bytes = burst["length"] * kv
    h2d_rate = best_rate(records, "h2d")
    hits = burst_docs(burst["requests"], burst["docs"])
    prefill = statistics.median(fills)
    costs = (burst["concurrency"], prefill, doc_bytes / (rate[0] * 1e9),
             doc_bytes / (h2d_rate * 1e9) if h2d_rate else 0.0)
    mean, wall = simulate(hits, *costs)
    in_order, _ = simulate(hits, *costs, in_order=True)
    return Floor(prefill, rate[0], h2d_rate, mean, wall, rate[1], in_order)
