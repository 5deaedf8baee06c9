"""The report: tables of TTFT and bandwidth per medium and length, the target ratios, warnings.

``h200_connector.py report FILE...`` (and every stage at its end) prints it and writes the
markdown. Reads result files of every run so far: records are deduplicated by id, and a
re-run of an engine replaces the earlier one's numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from h200bench import (auth_stage, decode_report, lmcache_stage, source_report, striping_report, tp_report,
                       verify_stage)
from h200bench.settings import ANCHORS, TARGETS
from h200bench.stats import load_gb_per_s
from h200bench.util import expected_chunks


def load_records(files: list[str]) -> list[dict]:
    seen, out = set(), []
    for name in files:
        for line in Path(name).read_text().splitlines():
            line = line.strip()
            if not line or not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            rid = rec.get("rid") or json.dumps(rec, sort_keys=True)
            if rid in seen:
                continue
            seen.add(rid)
            out.append(rec)
    out.sort(key=lambda r: r.get("ts", 0))
    return out


def latest_run(records: list[dict], **match) -> list[dict]:
    """Records matching ``match`` from the latest engine (label) that produced any."""
    hits = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    if not hits:
        return []
    last_label_ts: dict[str, float] = {}
    for r in hits:
        last_label_ts[r.get("label", "")] = r.get("ts", 0)
    # the latest process of that label: records after its last "engine" record
    label = max(last_label_ts, key=last_label_ts.get)
    starts = [r["ts"] for r in records if r.get("kind") == "engine" and r.get("label") == label]
    since = max(starts) if starts else 0
    return [r for r in hits if r.get("label") == label and r.get("ts", 0) >= since]


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def build_report(records: list[dict]) -> tuple[str, str, dict]:
    """(plain text, markdown, summary dict) of everything measured."""
    ttft = [r for r in records if r.get("kind") == "ttft"]
    lengths = sorted({r["length"] for r in ttft})
    bws = [r for r in records if r.get("kind") == "bw" and "gb_per_s" in r]

    def ttft_of(length: int, **match) -> tuple[float | None, list[dict]]:
        rows = [r for r in latest_run(ttft, **match) if r["length"] == length]
        return median([r["ttft"] for r in rows]), rows

    def bw_of(medium: str | None, what: str) -> float | None:
        vals = [r["gb_per_s"] for r in bws if r.get("what") == what and (medium is None or r.get("medium") == medium)]
        return max(vals) if vals else None

    h2d = bw_of(None, "h2d")
    media = [m for m in ("virtio", "loop", "shm") if any(r.get("medium") == m for r in ttft + bws)]
    text, md, summary, warnings = [], [], {"media": {}, "h2d_gb_per_s": h2d}, []
    header = ["length", "recompute", "pykv fill", "pykv disk hit", "pykv disk hit (full)", "pykv DRAM hit", "native CPU",
              "native fs", "LMCache", "LMCache fresh engine", "pykv load GB/s", "pykv e2e GB/s", "pykv load GB/s (full)",
              "DRAM load GB/s", "O_DIRECT GB/s", "pykv files GB/s", "H2D GB/s", "load/O_DIRECT", "DRAM/native CPU",
              "native fs/pykv", "LMCache/pykv"]
    for medium in media:
        odirect = bw_of(medium, "odirect_read")
        files_bw = bw_of(medium, "files_read")
        rows = []
        msum = {"odirect_gb_per_s": odirect, "files_gb_per_s": files_bw, "lengths": {}}
        for length in lengths:
            rec, _ = ttft_of(length, system="recompute", medium=None, phase="query")  # stage T's: medium tpN
            pfill, _ = ttft_of(length, system="pykv", medium=medium, variant="header", phase="fill")
            disk, disk_rows = ttft_of(length, system="pykv", medium=medium, variant="header", phase="query")
            full, full_rows = ttft_of(length, system="pykv", medium=medium, variant="full", phase="query")
            dram, dram_rows = ttft_of(length, system="pykv", medium=medium, variant="header", phase="dram")
            ncpu, _ = ttft_of(length, system="native_cpu", phase="query")
            nfs, _ = ttft_of(length, system="native_fs", medium=medium, phase="query")
            lmc, _ = ttft_of(length, system=lmcache_stage.SYSTEM, medium=medium, variant=lmcache_stage.SAME,
                             phase="query")
            lmc_fresh, _ = ttft_of(length, system=lmcache_stage.SYSTEM, medium=medium, variant=lmcache_stage.FRESH,
                                   phase="query")
            load = median([load_gb_per_s(r) for r in disk_rows])
            e2e = median([r.get("e2e_gb_per_s") for r in disk_rows])
            load_full = median([load_gb_per_s(r) for r in full_rows])
            dram_load = median([load_gb_per_s(r) for r in dram_rows])
            r_load = load / odirect if load and odirect else None
            r_dram = dram / ncpu if dram and ncpu else None
            r_fs = nfs / disk if nfs and disk else None
            r_lmc = lmc / disk if lmc and disk else None
            for r in disk_rows + full_rows:
                if r.get("cached") is not None and r["cached"] < r.get("expected_cached", 0):
                    warnings.append(f"{medium} {r['variant']} L={length} doc {r['doc']}: disk query cached "
                                    f"{r['cached']} of {r['expected_cached']} tokens (partial hit)")
                if r.get("load_blocks_dram"):
                    warnings.append(f"{medium} L={length} doc {r['doc']}: 'disk hit' served "
                                    f"{r['load_blocks_dram']} blocks from DRAM")
            for r in dram_rows:
                if r.get("load_blocks_disk") or r.get("load_blocks_dram", 0) < expected_chunks(length):
                    warnings.append(f"{medium} L={length} doc {r['doc']}: DRAM query read {r.get('load_blocks_disk')} "
                                    f"blocks from disk, {r.get('load_blocks_dram')} from DRAM "
                                    f"(expected at least {expected_chunks(length)} from DRAM)")
            row = [f"{length:,}", fmt(rec), fmt(pfill), fmt(disk), fmt(full), fmt(dram), fmt(ncpu), fmt(nfs),
                   fmt(lmc), fmt(lmc_fresh), fmt(load, ".2f"), fmt(e2e, ".2f"), fmt(load_full, ".2f"),
                   fmt(dram_load, ".2f"), fmt(odirect, ".2f"), fmt(files_bw, ".2f"), fmt(h2d, ".1f"), fmt(r_load, ".2f"),
                   fmt(r_dram, ".2f"), fmt(r_fs, ".2f"), fmt(r_lmc, ".2f")]
            rows.append(row)
            msum["lengths"][length] = {"recompute": rec, "pykv_fill": pfill, "pykv_disk": disk, "pykv_disk_full": full,
                                       "pykv_dram": dram, "native_cpu": ncpu, "native_fs": nfs,
                                       "lmcache": lmc, "lmcache_fresh": lmc_fresh, "lmcache_vs_pykv": r_lmc,
                                       "load_gb_per_s": load, "e2e_gb_per_s": e2e, "load_full_gb_per_s": load_full,
                                       "load_vs_odirect": r_load, "dram_vs_native_cpu": r_dram,
                                       "fs_vs_pykv": r_fs}
        summary["media"][medium] = msum
        # drop columns with nothing in them
        keep = [i for i in range(len(header)) if i == 0 or any(row[i] != "—" for row in rows)]
        head = [header[i] for i in keep]
        body = [[row[i] for i in keep] for row in rows]
        widths = [max(len(head[j]), *(len(b[j]) for b in body)) for j in range(len(head))]
        title = {"virtio": "virtio disk", "loop": "loop device in /dev/shm",
                 "shm": "DRAM hits (pykv tree in /dev/shm)"}[medium]
        text.append(f"== {title}: TTFT in seconds (median over documents), bandwidth in GB/s ==")
        text.append("  ".join(h.rjust(w) for h, w in zip(head, widths)))
        for b in body:
            text.append("  ".join(c.rjust(w) for c, w in zip(b, widths)))
        md.append(f"### {title}\n")
        md.append("| " + " | ".join(head) + " |")
        md.append("|" + "|".join("---:" for _ in head) + "|")
        for b in body:
            md.append("| " + " | ".join(b) + " |")
        md.append("")
        lines = target_lines(medium, msum, odirect)
        if lines:
            text.append("targets:")
            text.extend("  " + line for line in lines)
            md.append("Targets:\n")
            md.extend(f"- {line}" for line in lines)
            md.append("")
        text.append("")
    sections = (("striping", striping_report.build(records)), ("itl", decode_report.build(records)),
                ("auth", auth_stage.build(records)), ("tp", tp_report.build(records)),
                ("verify", verify_stage.build(records)), ("lmcache", lmcache_stage.build(records)),
                ("sources", source_report.build(records)))
    for key, section in sections:
        if section:
            text.extend(section.text)
            md.extend(section.md)
            summary[key] = section.summary
            warnings.extend(section.warnings)
    other = [r for r in bws if r.get("what") in ("odirect_read", "odirect_write", "files_read", "files_write",
                                                    "h2d", "d2h")]
    if other:
        text.append("== bandwidth probes ==")
        md.append("### Bandwidth probes\n")
        md.append("| medium | what | engine | GB/s |")
        md.append("|---|---|---|---:|")
        for r in other:
            line = f"{r.get('medium') or '-':7} {r['what']:14} {r.get('engine', '-'):28} {r['gb_per_s']:.2f}"
            text.append(line)
            md.append(f"| {r.get('medium') or '-'} | {r['what']} | {r.get('engine', '-')} | {r['gb_per_s']:.2f} |")
        text.append("")
        md.append("")
    engines = [r for r in records if r.get("kind") == "engine"]
    if engines:
        text.append("engine starts: " + ", ".join(f"{r['label']} {r['start_s']:.0f}s" for r in engines))
    failed = [r for r in records if r.get("kind") == "process" and r.get("rc") != 0]
    for r in failed:
        warnings.append(f"process {r['label']} (stage {r['stage']}) exited with rc {r['rc']}")
    for r in records:
        if r.get("kind") == "skipped":
            warnings.append(f"{r['label']}: skipped ({r.get('why')})")
        if r.get("kind") == "bw" and r.get("error"):
            warnings.append(f"bw {r.get('medium')} {r.get('what')} {r.get('engine', '')}: {r['error']}")
    anchor = "anchors (same method, shared/device/README.md): " + "; ".join(
        f"{k} " + "/".join(f"{v:g}" for v in d.values()) for k, d in ANCHORS.items())
    text.append(anchor)
    md.append(f"_{anchor}_\n")
    if warnings:
        text.append("warnings:")
        text.extend("  - " + w for w in warnings)
        md.append("Warnings:\n")
        md.extend(f"- {w}" for w in warnings)
    summary["warnings"] = warnings
    return "\n".join(text), "\n".join(md) + "\n", summary


def target_lines(medium: str, msum: dict, odirect: float | None) -> list[str]:
    """One PASS/FAIL line per length and target that the medium's numbers allow checking."""
    lines = []
    for length, s in msum["lengths"].items():
        if s["load_vs_odirect"] is not None:
            ok = s["load_vs_odirect"] >= TARGETS["load_vs_odirect"]
            lines.append(f"L={length:,}: disk-hit load {fmt(s['load_gb_per_s'], '.2f')} GB/s = "
                         f"{s['load_vs_odirect']:.0%} of O_DIRECT {fmt(odirect, '.2f')} "
                         f"(target >= 90%): {'PASS' if ok else 'FAIL'}")
        if s["dram_vs_native_cpu"] is not None:
            ok = s["dram_vs_native_cpu"] <= TARGETS["dram_vs_native_cpu"]
            lines.append(f"L={length:,}: DRAM hit {fmt(s['pykv_dram'])} s = {s['dram_vs_native_cpu']:.2f}x "
                         f"native CPU {fmt(s['native_cpu'])} s (target <= 1.05x): {'PASS' if ok else 'FAIL'}")
        if s["fs_vs_pykv"] is not None and medium == "loop" and length >= 32768:
            ok = s["fs_vs_pykv"] >= TARGETS["fs_vs_pykv_loop"]
            lines.append(f"L={length:,}: native fs {fmt(s['native_fs'])} s / pykv disk hit "
                         f"{fmt(s['pykv_disk'])} s = {s['fs_vs_pykv']:.2f}x (target >= 1.5x): "
                         f"{'PASS' if ok else 'FAIL'}")
    return lines


def report_main(a: argparse.Namespace) -> int:
    records = load_records(a.files)
    text, md, summary = build_report(records)
    print(text)
    if a.md:
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text("# pykv on the H200 host\n\n" + md)
        print(f"\nmarkdown: {a.md}")
    return 0
