"""The report of stages S1-S3 (issue 17): aggregate O_DIRECT reads, TTFT of pykv over N devices and
over one, vLLM's native fs tier on one device per thread setting, the calibration of the set, and
the issue's targets, PASS or FAIL.

``report.build_report`` appends this section when the records hold any ``stripe*`` medium.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h200bench.multibw import AGG_WHAT, COPY_WHAT, FILES_WHAT
from h200bench.settings import STRIPE_TARGETS
from h200bench.stats import load_gb_per_s


@dataclass
class Section:
    text: list[str] = field(default_factory=list)
    md: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def titled(cls, title: str) -> "Section":
        """A section that opens with ``title`` (text and markdown)."""
        s = cls()
        s.text.append(f"== {title} ==")
        s.md.append(f"### {title}\n")
        return s

    def table(self, title: str, head: list[str], rows: list[list[str]]) -> None:
        widths = [max(len(h), *(len(r[j]) for r in rows)) if rows else len(h) for j, h in enumerate(head)]
        self.text.append(f"-- {title} --")
        self.text.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        self.text.extend("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
        self.md += [f"#### {title}\n", "| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
        self.md += ["| " + " | ".join(r) + " |" for r in rows] + [""]
        self.text.append("")

    def lines(self, title: str, lines: list[str]) -> None:
        if lines:
            self.text += [title] + [f"  {line}" for line in lines] + [""]
            self.md += [f"{title}\n"] + [f"- {line}" for line in lines] + [""]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def stripe_counts(records: list[dict]) -> list[int]:
    return sorted({int(r["medium"][len("stripe"):]) for r in records
                   if str(r.get("medium") or "").startswith("stripe") and r["medium"][len("stripe"):].isdigit()})


def aggregate_odirect(records: list[dict], count: int) -> dict[tuple[int, int], float]:
    """Best aggregate O_DIRECT read GB/s of ``count`` devices per (request bytes, depth per device)."""
    best: dict[tuple[int, int], float] = {}
    for r in records:
        if r.get("what") == AGG_WHAT and r.get("devices") == count and r.get("gb_per_s"):
            key = (r["block"], r["depth"])
            best[key] = max(best.get(key, 0.0), r["gb_per_s"])
    return best


def reactor_lines(records: list[dict], reference: dict[int, float | None]) -> list[str]:
    """Best reactor file-load GB/s per (devices, engine, verify, depth when several were run), and its share
    of the O_DIRECT reference."""
    best: dict[tuple[int, str, str], float] = {}
    files = [r for r in records if r.get("what") == FILES_WHAT and r.get("gb_per_s")]
    several_depths = len({r.get("depth") for r in files}) > 1
    for r in files:
        if r.get("what") == FILES_WHAT and r.get("gb_per_s"):
            threads = f", {r['verify_threads']} hashing threads" if r.get("verify_threads") else ""
            depth = f", depth {r.get('depth')}" if several_depths else ""
            key = (r["devices"], r["engine"], r.get("verify", "header") + threads + depth)
            best[key] = max(best.get(key, 0.0), r["gb_per_s"])
    lines = []
    for (n, engine, verify), rate in sorted(best.items()):
        share = f" = {rate / reference[n]:.0%} of O_DIRECT" if reference.get(n) else ""
        lines.append(f"{n} devices, {engine}, verify={verify}: {rate:.2f} GB/s{share}")
    return lines or ["not measured"]


def time_split(rows: list[dict], lengths: list[int]) -> list[str]:
    """Per length, a disk hit's TTFT split by pykv's counters: the scheduler's survey of its blocks
    (``survey_us``), the load job (``load_job_us``), the wait until vLLM collected the finished job
    (``load_report_wait_us``), and the rest (vLLM's steps, the last block's prefill)."""
    from h200bench.report import median

    lines = []
    for length in lengths:
        hits = [r for r in rows if r["length"] == length and r.get("load_job_us")]
        if not hits:
            continue
        parts = {"ttft": [r["ttft"] * 1e3 for r in hits],
                 "survey": [r.get("scheduler_delta", {}).get("survey_us", 0) / 1e3 for r in hits],
                 "load": [r["load_job_us"] / 1e3 for r in hits],
                 "wait": [r.get("worker_delta", {}).get("load_report_wait_us", 0) / 1e3 for r in hits]}
        rest = [t - a - b - c for t, a, b, c in zip(parts["ttft"], parts["survey"], parts["load"], parts["wait"])]
        m = {k: median(v) for k, v in parts.items()}
        lines.append(f"L={length:,}: TTFT {m['ttft']:.0f} ms = survey {m['survey']:.1f} + load job {m['load']:.0f} "
                     f"+ report wait {m['wait']:.1f} + the rest {median(rest):.0f} (n={len(hits)})")
        lines += [line for line in (copier_line(hits), disk_line(hits), timeline_line(hits)) if line]
    return lines or ["no load-job counters recorded"]


STEP_NAMES = (("survey_began", "survey began"), ("survey_ended", "ended"), ("load_planned", "load planned"),
              ("load_submitted", "at the worker"), ("load_ended", "loaded"), ("load_reported", "collected"),
              ("first_token", "first token"))


def timeline_line(hits: list[dict]) -> str | None:
    """When each step of those requests' loads happened, ms from the request (medians of the
    records' ``timeline``); None where the records lack it."""
    from h200bench.report import median

    steps = [r["timeline"] for r in hits if r.get("timeline")]
    parts = []
    for key, name in STEP_NAMES:
        at = median([s[key] for s in steps if key in s])
        if at is not None:
            parts.append(f"{name} {at:.1f}")
    return f"  the steps, ms from the request: {', '.join(parts)}" if parts else None


def disk_line(hits: list[dict]) -> str | None:
    """The devices during those requests (``diskstats`` deltas): each device's busy time as a share
    of the load job, its share of the bytes read, and its read rate while busy; ranges over
    devices and requests. None where the records lack them."""
    busy, share, rate = [], [], []
    for r in hits:
        disks = r.get("disks") or {}
        total = sum(d["read_bytes"] for d in disks.values())
        for d in disks.values():
            busy.append(d["busy_ms"] / (r["load_job_us"] / 1e3))
            share.append(d["read_bytes"] / total * len(disks) if total else 0.0)
            if d["busy_ms"]:
                rate.append(d["read_bytes"] / (d["busy_ms"] / 1e3) / 1e9)
    if not busy:
        return None
    return (f"  the devices: busy {min(busy):.0%}-{max(busy):.0%} of the load job, bytes {min(share):.2f}-"
            f"{max(share):.2f}x the mean per device, {min(rate):.2f}-{max(rate):.2f} GB/s per device while busy")


def copier_line(hits: list[dict]) -> str | None:
    """The copier's side of those loads (medians of the worker's ``h2d_*`` deltas, ms): batches,
    time issuing them (building pointer lists, in the batched op's call) and batches queued for its
    thread; None where the records lack the counters."""
    from h200bench.report import median

    deltas = [r.get("worker_delta", {}) for r in hits]
    if not all("h2d_issue_us" in d for d in deltas):
        return None

    def ms(key: str) -> float:
        return median([d.get(key, 0) / 1e3 for d in deltas])
    parts = f"build {ms('h2d_build_us'):.0f}, op {ms('h2d_op_us'):.0f}; " if all("h2d_op_us" in d for d in deltas) else ""
    return (f"  the copier: {median([d.get('h2d_batches', 0) for d in deltas]):.0f} batches, issuing "
            f"{ms('h2d_issue_us'):.0f} ms ({parts}queued for its thread {ms('h2d_queued_us'):.0f})")


def copy_lines(records: list[dict]) -> list[str]:
    """The best host copy rate per thread count (``multibw.host_copy``)."""
    best: dict[int, float] = {}
    for r in records:
        if r.get("what") == COPY_WHAT and r.get("gb_per_s"):
            best[r["threads"]] = max(best.get(r["threads"], 0.0), r["gb_per_s"])
    return [f"{n} threads: {rate:.2f} GB/s copied" for n, rate in sorted(best.items())] or ["not measured"]


def build(records: list[dict]) -> Section | None:
    from h200bench.report import fmt, latest_run, median  # the report's helpers (it imports this module)

    counts = stripe_counts(records)
    if not counts:
        return None
    many = max(counts)
    s = Section.titled(f"Issue 17: {many} loop devices in /dev/shm as one pykv cache (stages S1-S3)")
    ttft = [r for r in records if r.get("kind") == "ttft" and r.get("phase") == "query"]
    lengths = sorted({r["length"] for r in ttft if str(r.get("medium", "")).startswith("stripe")})

    # O_DIRECT, aggregate
    odirect = {n: aggregate_odirect(records, n) for n in counts}
    configs = sorted({k for best in odirect.values() for k in best})
    reference = {n: max(best.values()) if best else None for n, best in odirect.items()}
    s.table("O_DIRECT reads of N devices at once, GB/s (best pass)",
            ["devices"] + [f"{b >> 20} MiB x {d}/device" for b, d in configs] + ["reference"],
            [[str(n)] + [fmt(odirect[n].get(c), ".2f") for c in configs] + [fmt(reference[n], ".2f")] for n in counts])
    s.lines("host memory copy bandwidth (what loop-device reads, checksums and GPU copies share here):",
            copy_lines(records))
    s.lines("pykv's load path without the GPU copy (reactor over block files, all devices at once):",
            reactor_lines(records, reference))
    for r in records:
        if r.get("kind") == "pykv_bench":
            s.lines("pykv bench (the command):", [f"{r.get('medium')}: " + (
                f"error: {r['error']}" if "error" in r else best_bench_line(r.get("data") or {}))
                + (f" ({r['note']})" if r.get("note") else "")])

    # TTFT
    def ttft_rows(**match) -> list[dict]:
        return [r for r in latest_run(ttft, **match)]

    def pooled(rows: list[dict], **match) -> list[dict]:
        """The latest run of every engine label matching (a measurement repeated under another label)."""
        labels = sorted({r["label"] for r in rows if all(r.get(k) == v for k, v in match.items())})
        return [r for label in labels for r in latest_run(rows, label=label, **match)]

    pykv_rows = {n: pooled(ttft, system="pykv", medium=f"stripe{n}", variant="defaults") for n in counts}
    native_rows = [r for r in ttft if r.get("system") == "native_fs" and r.get("medium") == "stripe1"]
    variants = sorted({r["variant"] for r in native_rows}, key=lambda v: (v.endswith("again"), len(v), v))
    native = {v: ttft_rows(system="native_fs", medium="stripe1", variant=v) for v in variants}
    head = ["length"] + [f"pykv {n} dev" for n in counts] + [f"native {v}" for v in variants] + ["native best"]
    head += [f"load GB/s {n} dev" for n in counts] + [f"load/O_DIRECT {n} dev" for n in counts]
    rows, summary = [], {}
    for length in lengths:
        at = {n: [r for r in pykv_rows[n] if r["length"] == length] for n in counts}
        hit = {n: median([r["ttft"] for r in at[n]]) for n in counts}
        load = {n: median([load_gb_per_s(r) for r in at[n]]) for n in counts}
        ratio = {n: load[n] / reference[n] if load[n] and reference[n] else None for n in counts}
        fs = {v: median([r["ttft"] for r in native[v] if r["length"] == length]) for v in variants}
        fs_best = min((t for t in fs.values() if t), default=None)
        rows.append([f"{length:,}"] + [fmt(hit[n]) for n in counts] + [fmt(fs[v]) for v in variants] + [fmt(fs_best)]
                    + [fmt(load[n], ".2f") for n in counts] + [fmt(ratio[n], ".0%") if ratio[n] else "—" for n in counts])
        summary[length] = {"pykv": hit, "load_gb_per_s": load, "load_vs_odirect": ratio, "native": fs,
                           "native_best": fs_best}
        for n in counts:
            for r in at[n]:
                if r.get("cached") is not None and r["cached"] < r.get("expected_cached", 0):
                    s.warnings.append(f"stripe{n} L={length} doc {r['doc']}: disk query cached {r['cached']} of "
                                      f"{r['expected_cached']} tokens (partial hit)")
                if r.get("load_blocks_dram"):
                    s.warnings.append(f"stripe{n} L={length}: 'disk hit' served {r['load_blocks_dram']} blocks from DRAM")
    s.table("disk-hit TTFT in seconds (fresh engine, page cache dropped, DRAM tier 0; medians)", head, rows)
    s.summary = {"odirect_reference": reference, "lengths": summary}
    s.lines("targets:", target_lines(summary, reference, many))

    # placement, configuration, calibration
    notes = []
    for n in counts:
        for label in sorted({r["label"] for r in pykv_rows[n]}):
            per = [f"{length:,} {fmt(median([r['ttft'] for r in pykv_rows[n] if r['label'] == label and r['length'] == length]))} s"
                   for length in lengths]
            staging = [r for r in pykv_rows[n] if r["label"] == label and r.get("staging_bytes")]
            if staging:  # the worker's gauges (pykv.counters): how much staging THP gave
                r = staging[-1]
                per.append(f"staging {r['staging_bytes'] / 2**30:.1f} GiB, "
                           f"{r.get('staging_huge_bytes', 0) / r['staging_bytes']:.0%} on huge pages")
            notes.append(f"{label}: " + ", ".join(per))
    for r in records:
        if r.get("kind") == "tree" and r.get("files_per_device"):
            notes.append(f"{r['medium']}: block files per device {r['files_per_device']}")
        if r.get("kind") == "pykv_config":
            notes.append(f"{r['medium']}: configuration from `pykv config` ({r['source']}"
                         + (f"; command: {r['command_error']}" if r.get("command_error") else "")
                         + (", differs from the library's" if r.get("same_as_library") is False else "") + ")")
    s.lines("notes:", notes)
    s.lines(f"where a disk hit's time goes, {many} devices (medians over the query engines):",
            time_split(pykv_rows[many], lengths))
    s.lines("each query engine's loads in the order it ran them (document, copy entries per block, "
            "the busiest device's share of the load job):", load_order_lines([r for n in counts for r in pykv_rows[n]]))
    s.lines("calibration of the set (pykv calibrate):", calibration_lines(records))
    return s


def load_order_lines(rows: list[dict]) -> list[str]:
    """Per engine and length, each disk hit in the engine's order: a later load of the same document
    gets the GPU blocks an earlier one freed (descending); another document's files were not read
    before (run 17's one-device second loads were 20 % slower)."""
    loads: dict[tuple[str, int], list[str]] = {}
    for r in rows:  # records in the order the engine ran them
        blocks = r.get("worker_delta", {}).get("delivered_blocks") or r.get("load_blocks_disk")
        if not blocks:
            continue
        entries = r.get("worker_delta", {}).get("h2d_entries")
        busy = [d.get("busy_ms", 0) for d in (r.get("disks") or {}).values()]
        job_ms = (r.get("load_job_us") or 0) / 1000
        cell = f"doc {r.get('doc', 0)} {r['ttft']:.3f} s"
        extra = ([f"{entries / blocks:.0f}"] if entries is not None else []) + \
            ([f"busiest {max(busy) / job_ms:.0%}"] if busy and job_ms else [])
        loads.setdefault((r["label"], r["length"]), []).append(cell + (f" ({', '.join(extra)})" if extra else ""))
    return [f"{label} L={length:,}: " + " / ".join(cells) for (label, length), cells in loads.items()]


def best_bench_line(data: dict) -> str:
    reads = [r for r in data.get("results", []) if r.get("op") == "read" and r.get("gb_per_s")]
    if not reads:
        return "no read results"
    best = max(reads, key=lambda r: r["gb_per_s"])
    return f"best read {best['gb_per_s']:.2f} GB/s ({best.get('engine', '?')}, depth {best.get('depth', '?')})"


def target_lines(summary: dict, reference: dict, many: int) -> list[str]:
    t = STRIPE_TARGETS
    lines = []
    for length, s in summary.items():
        ratio, load = s["load_vs_odirect"].get(many), s["load_gb_per_s"].get(many)
        if ratio is not None:
            lines.append(f"L={length:,}: load path on {many} devices {load:.2f} GB/s = {ratio:.0%} of aggregate O_DIRECT "
                         f"{reference[many]:.2f} GB/s (target >= {t['load_vs_aggregate_odirect']:.0%}): "
                         f"{verdict(ratio >= t['load_vs_aggregate_odirect'])}")
        hit = s["pykv"].get(many)
        if hit is not None and length in t["ttft_max_s"]:
            lines.append(f"L={length:,}: disk hit on {many} devices {hit:.3f} s (target <= {t['ttft_max_s'][length]} s): "
                         f"{verdict(hit <= t['ttft_max_s'][length])}")
        if hit and s["native_best"] and length in t["ttft_max_s"]:
            x = s["native_best"] / hit
            lines.append(f"L={length:,}: native fs on one device (best, {s['native_best']:.3f} s) / pykv on {many} "
                         f"devices = {x:.2f}x (target >= {t['vs_native_one_device']:g}x): "
                         f"{verdict(x >= t['vs_native_one_device'])}")
        one = s["pykv"].get(1)
        if one and s["native_best"] and length in t["one_device_lengths"]:
            x = s["native_best"] / one
            lines.append(f"L={length:,}: one device, native fs best {s['native_best']:.3f} s / pykv defaults "
                         f"{one:.3f} s = {x:.2f}x (target >= {t['one_device_vs_native_best']:g}x): "
                         f"{verdict(x >= t['one_device_vs_native_best'])}")
    return lines


def calibration_lines(records: list[dict]) -> list[str]:
    lines = []
    for r in records:
        if r.get("kind") != "calibration" or not str(r.get("medium", "")).startswith("stripe"):
            continue
        be = ", ".join(f"{tier} {'never' if v is None else f'{v:,.0f} tokens'}"
                       for tier, v in (r.get("break_even") or {}).items())
        bw = r.get("read_gb_per_s")
        lines.append(f"{r['medium']} ({r['file']}): break-even {be}; medium read "
                     f"{'—' if bw is None else f'{bw:.2f}'} GB/s")
        gate = r.get("gate_check")
        if gate:
            off = [f"{p['tokens']:,} ({p['ratio']:.2f}x)" for p in gate["points"] if not p["ok"]]
            lines.append(f"gated sweep: max {gate['max_ratio']:.2f}x the better path (target <= "
                         f"{STRIPE_TARGETS['gate_tolerance']:.2f}x at every length): {verdict(gate['all_ok'])}"
                         + (f"; outside: {', '.join(off)}" if off else "") + f"; right path everywhere: "
                         f"{gate.get('all_right')}")
            if any("ratio_engines" in p for p in gate["points"]):  # the same runs against fresh engines alone
                each = ", ".join(f"{p['tokens']:,} {p['ratio']:.2f}/{p['ratio_engines']:.2f}" for p in gate["points"])
                lines.append(f"gated sweep per length (better path measured in the gated engine / in the recompute "
                             f"and disk engines): {each}")
            costs = [p for p in gate["points"] if "gate_share" in p]
            if costs:  # the gate's own decision time, in the gated engine (the same path)
                worst = max(costs, key=lambda p: p["gate_share"])
                lines.append(f"the gate's own cost: at most {max(p['gate_s'] for p in costs) * 1e6:.0f} us, "
                             f"{worst['gate_share']:.2%} of the better path (at {worst['tokens']:,} tokens)")
        elif gate is None:
            lines.append("gated sweep: not run")
    return lines
