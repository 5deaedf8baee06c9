"""The preloading stages' report: mean / p90 TTFT per burst engine, preload speed-up, and the
round-robin table (device bytes read against bytes delivered)."""

from __future__ import annotations

from h200bench.report import load_records


def report_main(files: list[str]) -> int:
    records = [r for r in load_records(files) if r.get("kind") == "burst"]
    latest: dict[tuple, dict] = {}
    for r in records:
        latest[(r["length"], r["system"], r["variant"])] = r
    lines = ["| length | system | TTFT mean (s) | TTFT p90 (s) | hits: mean | hits: p90 | preloads claimed | "
             "disk read / delivered |", "|---|---|---|---|---|---|---|---|"]
    for (length, system, variant), r in sorted(latest.items()):
        t, w = r["ttft"], r.get("worker_delta", {})
        ratio = (f"{w.get('disk_read_bytes', 0) / w['delivered_bytes']:.2f}" if w.get("delivered_bytes") else "-")
        lines.append(f"| {length // 1024}k | {system} {variant} | {t['all']['mean']} | {t['all']['p90']} | "
                     f"{t['hit']['mean']} | {t['hit']['p90']} | {w.get('preloads_claimed', '-')} | {ratio} |")
    for length in sorted({k[0] for k in latest}):
        on, off = latest.get((length, "pykv", "preload-on")), latest.get((length, "pykv", "preload-off"))
        native = latest.get((length, "native_fs", ""))
        if on and off:
            lines.append(f"\n{length // 1024}k: preload speed-up (mean TTFT, all requests) "
                         f"{off['ttft']['all']['mean'] / on['ttft']['all']['mean']:.2f}x"
                         + (f"; vs native fs {native['ttft']['all']['mean'] / on['ttft']['all']['mean']:.2f}x"
                            if native else ""))
    turns = {r["system"]: r for r in load_records(files) if r.get("kind") == "turns"}
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
