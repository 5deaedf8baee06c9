"""The report of stage I (issue 19): the decodes' inter-token latency per configuration while long
prompts were in flight, the ratios pykv / none and pykv / native, the targets, PASS or FAIL.

``report.build_report`` appends this section when the records hold any ``itl`` record.
"""

from __future__ import annotations

from h200bench.settings import ITL_TARGETS
from h200bench.striping_report import Section, verdict

ORDER = ("none", "pykv", "native")


def latest_itl(records: list[dict]) -> dict[str, dict]:
    """The latest ``itl`` record of each system."""
    latest: dict[str, dict] = {}
    for r in records:
        if r.get("kind") == "itl":
            latest[r["system"]] = r  # records come sorted by time
    return latest


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(latest: dict[str, dict], part: str = "window") -> dict[str, dict[str, float | None]]:
    """pykv's mean and p99 ITL over ``part`` divided by none's and native's."""
    pykv = latest.get("pykv", {}).get("itl", {}).get(part, {})
    out = {}
    for other in ("none", "native"):
        base = latest.get(other, {}).get("itl", {}).get(part, {})
        out[other] = {"mean": ratio(pykv.get("mean_ms"), base.get("mean_ms")),
                      "p99": ratio(pykv.get("p99_ms"), base.get("p99_ms"))}
    return out


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "—" if v is None else f"{v:{spec}}"


def work_cell(r: dict) -> str:
    """What the connector did in the background: blocks stored, loaded, preloads claimed."""
    w = r.get("worker_delta") or {}
    if r["system"] != "pykv":
        return "—"
    loads = w.get("load_blocks_disk", 0) + w.get("load_blocks_dram", 0)
    return f"{w.get('store_blocks', 0)} / {loads} / {w.get('preloads_claimed', 0)}"


def build(records: list[dict]) -> Section | None:
    latest = latest_itl(records)
    if not latest:
        return None
    any_r = next(iter(latest.values()))
    lengths = "/".join(f"{x / 1024:g}k" for x in any_r["long_lengths"])
    s = Section.titled(f"Issue 19: decode ITL beside background stores and loads (stage I: {any_r['decode_seqs']} "
                       f"decodes, {any_r['long_requests']} long prompts of {lengths} tokens every "
                       f"{any_r['long_gap_s']} s, half stored)")
    rows = []
    for system in sorted(latest, key=lambda k: ORDER.index(k) if k in ORDER else 9):
        r = latest[system]
        itl, t = r["itl"], r["ttft"]
        w, q, o = itl.get("window", {}), itl.get("quiet", {}), itl["overall"]
        before, after = itl.get("before", {}), itl.get("after", {})
        rows.append([system, fmt(w.get("mean_ms")), fmt(w.get("p50_ms")), fmt(w.get("p99_ms")), str(w.get("n", 0)),
                     fmt(q.get("mean_ms")), fmt(before.get("mean_ms")), fmt(after.get("mean_ms")),
                     fmt(o.get("mean_ms")), fmt(o.get("p99_ms")),
                     fmt(itl.get("window_s"), ".1f"), fmt(itl.get("coverage")), fmt(t["hit"]["mean"], ".3f"),
                     fmt(t["miss"]["mean"], ".3f"), work_cell(r)])
    s.table("decode inter-token latency, ms (window: while long prompts were in flight; quiet: outside it, "
            "before and after it)",
            ["system", "window mean", "p50", "p99", "tokens", "quiet mean", "before", "after", "overall mean",
             "overall p99",
             "window s", "coverage", "long TTFT hits s", "misses s", "pykv stored / loaded / preloads claimed"], rows)
    lines, summary = [], {"systems": {k: {"itl": v["itl"], "ttft": v["ttft"]} for k, v in latest.items()}}
    for part in ("window", "after", "overall"):
        rs = ratios(latest, part)
        summary[f"ratios_{part}"] = rs
        for other, limit, name in (("none", ITL_TARGETS["vs_none"], "no connector"),
                                   ("native", ITL_TARGETS["vs_native"], "native offloading")):
            for stat in ("mean", "p99"):
                value = rs[other][stat]
                if value is None:
                    continue
                if part == "window":
                    lines.append(f"window {stat} ITL pykv / {name} = {value:.3f}x (target <= {limit:.2f}x): "
                                 f"{verdict(value <= limit)}")
                elif part == "after":
                    lines.append(f"after-window {stat} ITL pykv / {name} = {value:.3f}x (context: the stream's "
                                 "stores still being written)")
                else:
                    lines.append(f"overall {stat} ITL pykv / {name} = {value:.3f}x (context)")
    for other in ("none", "native"):
        if "pykv" in latest and other not in latest:
            lines.append(f"pykv / {other}: no {other} record (not run, or skipped: native in --cpu-smoke)")
    if "pykv" not in latest:
        lines.append("no pykv record: no ratio")
    s.lines("targets (issue 19: window ITL, mean and p99):", lines)
    s.summary = summary
    for system, r in latest.items():
        itl = r["itl"]
        if itl.get("coverage") is not None and itl["coverage"] < 1.0:
            s.warnings.append(f"itl {system}: the decodes covered {itl['coverage']:.0%} of the stream's window "
                              f"(raise --decode-max-tokens)")
        if itl.get("tokens") and itl.get("merged_outputs", 0) > 0.01 * itl["tokens"]:
            s.warnings.append(f"itl {system}: {itl['merged_outputs']} outputs carried more than one token "
                              f"(the client fell behind; their gaps are shared evenly)")
        if system == "pykv":
            w = r.get("worker_delta") or {}
            if not w.get("store_blocks"):
                s.warnings.append("itl pykv: no block stored during the run (no background stores measured)")
            if not (w.get("load_blocks_disk", 0) + w.get("load_blocks_dram", 0)):
                s.warnings.append("itl pykv: no block loaded during the run (no background loads measured)")
        if system != "none":
            partial = [x["id"] for x in r.get("longs", []) if x["hit"] and not x.get("cached")]
            if partial:
                s.warnings.append(f"itl {system}: stored prompts served without a cache hit: {', '.join(partial)}")
    return s
