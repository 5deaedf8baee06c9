"""The preloading stages' report: mean / p90 TTFT per burst engine, preload speed-up, and the
round-robin table (device bytes read against bytes delivered)."""

from __future__ import annotations

import statistics

from h200bench.preload_floor import burst_floor
from h200bench.report import load_records


def burst_lines(records: list[dict]) -> list[str]:
    """Every burst of the files (in order), each against its floor (``preload_floor``), and the
    preload speed-up and native ratio from the means of all samples of each system."""
    bursts = [r for r in records if r.get("kind") == "burst"]
    if not bursts:
        return []
    lines = ["| length | system | TTFT mean (s) | p90 | hits: mean | hits: p90 | misses: mean | wall (s) | "
             "floor mean (s) | mean / floor | wall / floor wall | mean / in-order floor | preloads claimed | "
             "disk read / delivered |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    floors = []
    for r in bursts:
        t, w, floor = r["ttft"], r.get("worker_delta", {}), burst_floor(r, records)
        ratio = f"{w.get('disk_read_bytes', 0) / w['delivered_bytes']:.2f}" if w.get("delivered_bytes") else "-"
        against = (f"{floor.mean_s:.3f} | {t['all']['mean'] / floor.mean_s:.2f}x | {r['wall_s'] / floor.wall_s:.2f}x | "
                   f"{t['all']['mean'] / floor.in_order_mean_s:.2f}x" if floor else "- | - | - | -")
        if floor and floor not in floors:
            floors.append(floor)
        lines.append(f"| {r['length'] // 1024}k | {r['system']} {r['variant']} | {t['all']['mean']} | "
                     f"{t['all']['p90']} | {t['hit']['mean']} | {t['hit']['p90']} | {t['miss']['mean']} | "
                     f"{r['wall_s']} | {against} | {w.get('preloads_claimed', '-')} | {ratio} |")
    for f in floors:
        lines.append(f"\nfloor: one cold prefill {f.prefill_s:.3f} s; medium {f.read_gb_per_s:.2f} GB/s "
                     f"({f.read_source}); DRAM hits "
                     + (f"at H2D {f.h2d_gb_per_s:.1f} GB/s" if f.h2d_gb_per_s else "free (no H2D probe)")
                     + f"; floor wall {f.wall_s:.1f} s, floor mean {f.mean_s:.3f} s, in vLLM's arrival "
                     f"order {f.in_order_mean_s:.3f} s")
    means: dict[tuple, list[float]] = {}
    for r in bursts:
        means.setdefault((r["length"], r["system"], r["variant"]), []).append(r["ttft"]["all"]["mean"])
    for length in sorted({k[0] for k in means}):
        on, off = means.get((length, "pykv", "preload-on")), means.get((length, "pykv", "preload-off"))
        native = means.get((length, "native_fs", ""))
        if on and off:
            lines.append(f"\n{length // 1024}k: preload speed-up (mean TTFT, all requests, {len(on)} + {len(off)} "
                         f"bursts) {statistics.fmean(off) / statistics.fmean(on):.2f}x"
                         + (f"; vs native fs {statistics.fmean(native) / statistics.fmean(on):.2f}x" if native else ""))
    return lines


def report_main(files: list[str]) -> int:
    records = load_records(files)
    lines = burst_lines(records)
    turns = {r["system"]: r for r in records if r.get("kind") == "turns"}
    if turns:
        lines += ["", "| round robin | working set / DRAM | later turns: TTFT mean | p90 | delivered GB | "
                  "device read GB | read / delivered | pykv's own reads GB | staging: slots high / bound |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for system, r in sorted(turns.items()):
            high, own = r.get("worker_after", {}).get("slots_high"), r.get("worker_delta", {}).get("disk_read_bytes")
            bound = r.get("staging_bytes")
            lines.append(f"| {system} | {r['working_set_bytes'] / max(1, r['dram_bytes']):.1f}x | "
                         f"{r['later_turns']['mean']} | {r['later_turns']['p90']} | {r['delivered_bytes'] / 1e9:.2f} | "
                         f"{'-' if r['disk_read_bytes'] is None else round(r['disk_read_bytes'] / 1e9, 2)} | "
                         f"{r['read_per_delivered'] if r['read_per_delivered'] is not None else '-'} | "
                         f"{'-' if own is None else round(own / 1e9, 2)} | "
                         f"{'-' if high is None else high} / {'-' if not bound else f'{int(bound) >> 20} MiB'} |")
    print("\n".join(lines))
    return 0
