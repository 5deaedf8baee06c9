"""Stage I's workload and statistics: the decode prompts, the stream of long prompts (stored
documents and fresh ones), and inter-token latencies over a time window."""

from __future__ import annotations

import math
import random
import statistics

from h200bench.util import doc_tokens

GPU_LONG_LENGTHS = (32768, 49152, 81920)
SMOKE_LONG_LENGTHS = (1024, 1536, 2560)
SUFFIX_TOKENS = 32


def decode_prompts(seqs: int, length: int, vocab: int) -> list[list[int]]:
    """The ``seqs`` short prompts of the long decodes (random token ids, one seed each)."""
    return [[random.Random(90_000 + i).randrange(vocab) for _ in range(length)] for i in range(seqs)]


def long_stream(lengths: list[int], requests: int, docs: int, vocab: int) -> list[dict]:
    """The stream: request ``i`` has length ``lengths[i % len(lengths)]``; even requests are stored
    document ``(i // 2) // len(lengths) % docs`` of that length plus a suffix of their own (hits, which
    the fill engine stored), odd ones fresh prompts (misses, which the engine stores). The same for
    every configuration: each system reads a tree of its own."""
    out = []
    for i in range(requests):
        length = lengths[i % len(lengths)]
        if i % 2 == 0:
            doc = (i // 2) // len(lengths) % docs
            rng = random.Random(20_000 + i)
            tokens = doc_tokens(length, doc, vocab) + [rng.randrange(vocab) for _ in range(SUFFIX_TOKENS)]
            out.append({"id": f"long{i}", "hit": True, "doc": doc, "length": length, "tokens": tokens})
        else:
            out.append({"id": f"long{i}", "hit": False, "doc": None, "length": length,
                        "tokens": doc_tokens(length, 7000 + i, vocab)})
    return out


def miss_tokens(lengths: list[int], requests: int) -> int:
    """Tokens of the stream's fresh prompts (what a storing system writes besides the fill)."""
    return sum(lengths[i % len(lengths)] for i in range(requests) if i % 2 == 1)


# -- inter-token latency -------------------------------------------------------------------------------
def token_gaps(arrivals: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """(arrival time, inter-token latency) per token after a request's first output.

    ``arrivals`` is one (seconds, new tokens) pair per output the client received. An output
    carrying ``n`` tokens (the client fell behind and vLLM merged steps) closes a gap ``g`` that
    ``n`` tokens share: ``n`` latencies of ``g / n`` each, so the mean stays exact."""
    out = []
    for (t_prev, _), (t, n) in zip(arrivals, arrivals[1:]):
        if n <= 0:
            continue
        share = (t - t_prev) / n
        out.extend((t, share) for _ in range(n))
    return out


def in_window(gaps: list[tuple[float, float]], start: float | None, end: float | None) -> list[float]:
    """The latencies of tokens that arrived in ``(start, end]``; None bounds are open."""
    return [g for t, g in gaps if (start is None or t > start) and (end is None or t <= end)]


def outside_window(gaps: list[tuple[float, float]], start: float, end: float) -> list[float]:
    """The latencies of tokens that arrived before ``start`` or after ``end`` (no long prompt in flight)."""
    return [g for t, g in gaps if t <= start or t > end]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def itl_stats(values: list[float]) -> dict:
    """n, mean, p50, p99 and max of inter-token latencies, in milliseconds."""
    if not values:
        return {"n": 0, "mean_ms": None, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"n": len(values), "mean_ms": round(statistics.fmean(values) * 1e3, 3),
            "p50_ms": round(percentile(values, 50) * 1e3, 3), "p99_ms": round(percentile(values, 99) * 1e3, 3),
            "max_ms": round(max(values) * 1e3, 3)}


def stream_window(longs: list[dict]) -> tuple[float, float] | None:
    """(first submission, last first token) of the stream: the time long prompts were in flight."""
    if not longs:
        return None
    return min(r["submitted"] for r in longs), max(r["submitted"] + r["ttft"] for r in longs)


def coverage(decodes: list[dict], window: tuple[float, float]) -> float:
    """The share of ``window`` during which every decode was still producing tokens."""
    start, end = window
    if end <= start or not decodes:
        return 0.0
    last = min(d["arrivals"][-1][0] if d["arrivals"] else start for d in decodes)
    return round(max(0.0, min(end, last) - start) / (end - start), 4)


def summarize_decodes(decodes: list[dict], window: tuple[float, float] | None) -> dict:
    """ITL statistics of all decodes together: in the window, outside it (and its parts before and
    after it), overall; merged outputs."""
    gaps = [g for d in decodes for g in token_gaps(d["arrivals"])]
    out = {"overall": itl_stats([g for _, g in gaps]),
           "merged_outputs": sum(1 for d in decodes for _, n in d["arrivals"][1:] if n > 1),
           "tokens": sum(n for d in decodes for _, n in d["arrivals"])}
    if window is not None:
        out["window"] = itl_stats(in_window(gaps, *window))
        out["quiet"] = itl_stats(outside_window(gaps, *window))
        out["before"] = itl_stats(in_window(gaps, None, window[0]))  # decodes alone
        out["after"] = itl_stats(in_window(gaps, window[1], None))  # the stream's stores may still be written
        out["window_s"] = round(window[1] - window[0], 3)
        out["coverage"] = coverage(decodes, window)
    return out

