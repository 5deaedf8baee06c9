"""The report of stage T (issue 19): TTFT at tensor parallelism N of recompute, pykv disk hits and
the native fs tier; block files and loads per rank; the TP=1 probe over the TP=N tree; the pykv
hit's greedy tokens against vLLM's own prefix-cache hit.

``report.build_report`` appends one section per ``tp*`` medium in the records.
"""

from __future__ import annotations

from h200bench.settings import CHUNK
from h200bench.striping_report import Section, verdict


def tp_media(records: list[dict]) -> list[str]:
    return sorted({r["medium"] for r in records if str(r.get("medium") or "").startswith("tp")
                   and r["medium"][2:].isdigit()})


def latest(records: list[dict], **match) -> dict | None:
    hits = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    return hits[-1] if hits else None


def build(records: list[dict]) -> Section | None:
    media = tp_media(records)
    if not media:
        return None
    s = Section()
    for name in media:
        section(s, [r for r in records if r.get("medium") == name], name)
    return s


def section(s: Section, records: list[dict], name: str) -> None:
    from h200bench.report import fmt, latest_run, median  # the report's helpers (it imports this module)

    tp = int(name[2:])
    s.text.append(f"== Issue 19: tensor parallelism {tp} (stage T) ==")
    s.md.append(f"### Issue 19: tensor parallelism {tp} (stage T)\n")
    ttft = [r for r in records if r.get("kind") == "ttft" and r.get("phase") == "query"]
    lengths = sorted({r["length"] for r in ttft})
    runs = {"recompute": latest_run(ttft, system="recompute"),
            "pykv": latest_run(ttft, system="pykv", variant="header"), "native": latest_run(ttft, system="native_fs"),
            "probe": latest_run(ttft, system="pykv", variant="tp1-over-tp2")}
    rows, summary = [], {}
    for length in lengths:
        at = {k: [r for r in v if r["length"] == length] for k, v in runs.items()}
        rec, hit, nfs = (median([r["ttft"] for r in at[k]]) for k in ("recompute", "pykv", "native"))
        ranks = rank_loads(at["pykv"])
        cached = sum(r.get("cached") or 0 for r in at["pykv"])
        expected = sum(r.get("expected_cached", 0) for r in at["pykv"])
        rows.append([f"{length:,}", fmt(rec), fmt(hit), fmt(nfs), fmt(rec / hit if rec and hit else None, ".2f", "x"),
                     fmt(nfs / hit if nfs and hit else None, ".2f", "x"), f"{cached:,} / {expected:,}",
                     " / ".join(str(n) for n in ranks) or "—"])
        summary[length] = {"recompute": rec, "pykv_disk": hit, "native_fs": nfs, "load_blocks_disk_per_rank": ranks}
        for r in at["pykv"]:
            if r.get("cached") is not None and r["cached"] < r.get("expected_cached", 0):
                s.warnings.append(f"{name} L={length} doc {r['doc']}: disk query cached {r['cached']} of "
                                  f"{r['expected_cached']} tokens (partial hit)")
            per = r.get("per_rank") or {}
            if per and len({c.get("load_blocks_disk") for c in per.values()}) != 1:
                s.warnings.append(f"{name} L={length}: the ranks loaded different block counts {rank_loads([r])}")
            if any(c.get("load_blocks_failed_disk") for c in per.values()):
                s.warnings.append(f"{name} L={length}: failed disk loads per rank {per}")
    s.table(f"TTFT in seconds at TP={tp} (fresh engines, page cache dropped; medians)",
            ["length", "recompute", "pykv disk hit", "native fs", "recompute/pykv", "native fs/pykv",
             "pykv cached / at least", "load_blocks_disk per rank"], rows)
    checks, notes = [], []
    trees = [r for r in records if r.get("kind") == "tp_tree"]
    for when, what in (("fill", "TP={tp} fill"), ("tp1-probe", "TP=1 probe"), ("end", "TP={tp} query")):
        tree = latest(trees, when=when)
        if tree:
            spaces = sorted(tree["namespaces"], key=lambda n: (-n["tp_size"], n["tp_rank"]))
            notes.append(f"block files after the {what.format(tp=tp)}: " + (", ".join(
                f"TP={n['tp_size']} rank {n['tp_rank']}: {n['files']}" for n in spaces) or "none"))
    filled = latest(trees, when="fill")
    if filled:
        own = [n["files"] for n in filled["namespaces"] if n["tp_size"] == tp]
        ok = len(own) == tp and len(set(own)) == 1 and own[0] > 0
        checks.append(f"one namespace per rank, each with its shard of every block ({own}): {verdict(ok)}")
    hits = [r for r in runs["pykv"] if r.get("per_rank")]
    if hits:
        ok = all(c.get("load_blocks_disk") == (r.get("cached") or 0) // CHUNK and not c.get("load_blocks_failed_disk")
                 for r in hits for c in r["per_rank"].values())
        checks.append(f"every rank's worker loaded each hit's blocks (cached tokens / {CHUNK}) itself, none failed: "
                      f"{verdict(ok)}")
    if runs["probe"]:
        cached = sum(r.get("cached") or 0 for r in runs["probe"])
        loads = sum(r.get("load_blocks_disk") or 0 for r in runs["probe"])
        checks.append(f"TP=1 engine over the TP={tp} tree: {cached} tokens cached, {loads} blocks loaded "
                      f"(must be 0): {verdict(cached == 0 and loads == 0)}")
        summary["tp1_over_tp"] = {"cached": cached, "load_blocks_disk": loads}
    tokens = [r for r in records if r.get("kind") == "tokens"]
    tp1_only = latest(tokens, phase="tp1-only")
    if tp1_only:
        checks.append(f"TP={tp} engine on a document only the TP=1 engine stored: {tp1_only.get('cached')} tokens "
                      f"cached (must be 0): {verdict(tp1_only.get('cached') == 0)}")
    equality = output_equality(tokens)
    if equality:
        checks.append(equality)
        summary["output_equal"] = equality.endswith("PASS")
    s.lines("checks:", checks)
    s.lines("notes:", notes)
    s.summary[name] = summary


def rank_loads(rows: list[dict]) -> list[int]:
    """``load_blocks_disk`` per rank, summed over the rows (a record's ``per_rank`` counters)."""
    total: dict[str, int] = {}
    for r in rows:
        for role, c in (r.get("per_rank") or {}).items():
            total[role] = total.get(role, 0) + c.get("load_blocks_disk", 0)
    return [total[role] for role in sorted(total)]


def output_equality(tokens: list[dict]) -> str | None:
    """The pykv hit's greedy tokens against the prefix-cache hit of the same prompt and length."""
    hit = latest(tokens, phase="hit")
    oracle = latest(tokens, phase="oracle", run=1)
    if not hit or not oracle:
        return None
    same_length = hit.get("cached") == oracle.get("cached")
    equal = same_length and hit.get("tokens") == oracle.get("tokens")
    blocks = (hit.get("cached") or 0) // CHUNK
    return (f"output of a {hit['length']:,}-token prompt, {len(hit.get('tokens') or [])} greedy tokens: pykv hit "
            f"({hit.get('cached')} cached, {blocks} blocks, per rank {rank_loads([hit])}) "
            f"{'equals' if equal else 'DIFFERS FROM'} vLLM's prefix-cache hit ({oracle.get('cached')} cached)"
            + ("" if same_length else " (hit lengths differ)")
            + ("" if equal else f": {hit.get('tokens')} vs {oracle.get('tokens')}") + f": {verdict(equal)}")
