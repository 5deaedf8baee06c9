"""The preloading stages' workloads: the burst (stored documents and fresh prompts), the
round-robin conversations, their TTFT summaries, and the tree and device measures around them."""

from __future__ import annotations

import math
import os
import random
import statistics
import zlib
from pathlib import Path

from h200bench.util import doc_tokens

STAGE_LENGTHS = {"P40": 40960, "P80": 81920}
SUFFIX_TOKENS = 32


def burst_docs(requests: int, docs: int) -> list[int | None]:
    """Each request's stored document in the burst, in order; None for a fresh prompt."""
    return [(i // 2) % docs if i % 2 == 0 else None for i in range(requests)]


def workload(length: int, requests: int, docs: int, vocab: int, salt: str) -> list[dict]:
    """The burst: even requests reuse a stored document (plus their own suffix), odd ones are fresh.
    ``salt`` (the engine's label) makes the fresh ones new for every engine: an earlier engine on
    the same tree stored the fresh prompts it computed."""
    fresh = zlib.crc32(salt.encode()) % 1_000_000 * 1000
    out = []
    for i, doc in enumerate(burst_docs(requests, docs)):
        rng = random.Random(10_000 + i)
        if doc is not None:
            tokens = doc_tokens(length, doc, vocab) + [rng.randrange(vocab) for _ in range(SUFFIX_TOKENS)]
            out.append({"id": f"r{i}", "hit": True, "doc": doc, "tokens": tokens})
        else:
            out.append({"id": f"r{i}", "hit": False, "doc": None,
                        "tokens": doc_tokens(length, 1000 + fresh + i, vocab)})
    return out


def p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def summarize(ttfts: list[dict]) -> dict:
    out = {}
    for name, rows in (("all", ttfts), ("hit", [r for r in ttfts if r["hit"]]),
                       ("miss", [r for r in ttfts if not r["hit"]])):
        values = [r["ttft"] for r in rows]
        out[name] = {"n": len(values), "mean": round(statistics.fmean(values), 4) if values else None,
                     "p90": round(p90(values), 4) if values else None}
    return out


def conversation_prompt(conversation: int, turn: int, base: int, step: int, vocab: int) -> list[int]:
    """Conversation ``conversation`` at ``turn``: its base document plus ``turn`` steps of new tokens
    (each turn's prompt extends the previous one, as a chat history does)."""
    tokens = doc_tokens(base, 5000 + conversation, vocab)
    for k in range(turn):
        rng = random.Random(conversation * 1_000 + k)
        tokens += [rng.randrange(vocab) for _ in range(step)]
    return tokens


def loop_read_bytes(device: str | None) -> int | None:
    """Bytes read from block device ``device`` (/dev/loopN) so far: sectors read x 512."""
    if not device:
        return None
    try:
        fields = Path(f"/sys/block/{os.path.basename(device)}/stat").read_text().split()
        return int(fields[2]) * 512
    except (OSError, IndexError, ValueError):
        return None


def tree_files(root: str) -> set[str]:
    """Every file under ``root`` (a pykv tree), as paths."""
    return {os.path.join(d, name) for d, _, names in os.walk(root) for name in names}


def remove_new_files(root: str, keep: set[str]) -> tuple[int, int]:
    """Delete the block files written under ``root`` since ``keep`` was listed (pykv's own
    ``.pykv`` bookkeeping stays); returns (files, bytes) removed."""
    files = size = 0
    for path in sorted(tree_files(root) - keep):
        if ".pykv" in Path(path).relative_to(root).parts:
            continue
        size += os.stat(path).st_size
        os.unlink(path)
        files += 1
    return files, size
