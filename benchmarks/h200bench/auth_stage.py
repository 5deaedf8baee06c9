"""Stage S4 (issue 20): what authenticated blocks cost a disk hit. pykv with ``pykv config``'s
defaults (``verify=full``) and the same with ``auth_key_file`` (signed stores, MAC-checked loads),
and the key with ``mac_threads=1``, on device 0 of the stripe set, each a fill engine and a fresh
query engine after the page cache is dropped; then all again while time allows, so the variants
alternate in one lease. The report section compares their disk-hit TTFT per length (target: at
most 5 % slower at 80k)."""

from __future__ import annotations

import os
import secrets

from h200bench import striping
from h200bench.striping_report import Section
from h200bench.util import log

VARIANT = "auth"
VARIANT_ONE_THREAD = "auth-1t"
"""The key with ``mac_threads=1``: each MAC on its verifier thread alone, not on BLAKE3's pool over
all cores (is the pool's contention with the engine what run 10's 1.16x was?)."""
VARIANT_NAMES = {VARIANT: "auth_key_file", VARIANT_ONE_THREAD: "auth_key_file, mac_threads=1"}
TARGET_RATIO = 1.05
TARGET_LENGTH = 81920
#: a fill and a query engine on the H200 (run 10: 36-38 s and 51-54 s): a repeat starts only with
#: this much time left, so the last keyed pair is not skipped for the generic optional margin
PAIR_S = 120


def key_file(runner) -> str:
    """A 0600 key file of one fresh key in the stage's work directory (made once per lease)."""
    path = str(runner.work / "auth.keys")
    if not runner.dry and not os.path.exists(path):
        from pykv.auth import write_key_file
        write_key_file(path, {"s4": secrets.token_bytes(32)})
    return path


def stage_s4(runner) -> None:
    mnts = striping.devices(runner)[:1]
    keys = {"auth_key_file": key_file(runner)}
    variants = (("defaults", None), (VARIANT, keys), (VARIANT_ONE_THREAD, {**keys, "mac_threads": 1}))
    try:
        for again in ("", "-again"):
            for variant, extra in variants:
                if again and not runner.dry and runner.remaining() < PAIR_S:
                    log(f"pykv {variant}{again}: skipped ({runner.remaining():.0f} s left)")
                    runner.record({"kind": "skipped", "stage": runner.stage, "label": f"pykv-{variant}{again}",
                                   "why": "time"})
                    continue
                striping.clear(runner, mnts)
                striping.pykv_disk_hits(runner, mnts, again, variant=variant, extra=extra)
    finally:
        striping.finish(runner, mnts)


def build(records: list[dict]) -> Section | None:
    """The report's section: S4's disk hits with and without a key (None when S4 has not run)."""
    lines = report_lines(records)
    if not lines:
        return None
    s = Section.titled("Issue 20: authenticated loads against verify=full, one device (stage S4)")
    s.lines("disk-hit TTFT (medians of both runs of each variant):", lines)
    s.summary = {"lines": lines}
    return s


def report_lines(records: list[dict]) -> list[str]:
    """Disk-hit TTFT with and without a key on one device, per length, and the target at 80k."""
    from h200bench.report import median

    ttft = [r for r in records if r.get("kind") == "ttft" and r.get("phase") == "query"
            and r.get("system") == "pykv" and r.get("medium") == "stripe1" and r.get("stage") == "S4"]
    if not any(r.get("variant") == VARIANT for r in ttft):
        return []
    lines = []
    for length in sorted({r["length"] for r in ttft}):
        full = median([r["ttft"] for r in ttft if r["length"] == length and r.get("variant") == "defaults"])
        if full is None:
            continue
        rates = {"defaults": load_rates(ttft, length, "defaults")}
        for variant, name in VARIANT_NAMES.items():
            auth = median([r["ttft"] for r in ttft if r["length"] == length and r.get("variant") == variant])
            if auth is None:
                continue
            ratio = auth / full
            target = f" (target <= {TARGET_RATIO:.2f}x): {'PASS' if ratio <= TARGET_RATIO else 'FAIL'}" \
                if length == TARGET_LENGTH else ""
            lines.append(f"L={length:,}: verify=full {full:.3f} s, {name} {auth:.3f} s = {ratio:.3f}x{target}")
            rates[variant] = load_rates(ttft, length, variant)
        if all(rates.values()) and len(rates) > 1:
            lines.append("  load jobs, GB/s per query: " + ", ".join(
                f"{VARIANT_NAMES.get(v, 'verify=full')} {fmt_rates(r)}" for v, r in rates.items()))
    for r in ttft:
        if r.get("cached") is not None and r["cached"] < r.get("expected_cached", 0):
            lines.append(f"warning: {r['label']} L={r['length']:,} cached {r['cached']} of {r['expected_cached']} tokens")
        if not r.get("load_blocks_disk") or r.get("load_blocks_failed_disk"):
            lines.append(f"warning: {r['label']} L={r['length']:,} loaded {r.get('load_blocks_disk')} blocks from disk, "
                         f"{r.get('load_blocks_failed_disk')} failed: not a clean disk hit")
    return lines


def load_rates(ttft: list[dict], length: int, variant: str) -> list[float]:
    """Each query's own load job in GB/s (its bytes over its time): the load path without TTFT's
    other parts, where run 10 told the two variants apart."""
    return sorted(r["load_job_bytes"] / r["load_job_us"] / 1e3 for r in ttft
                  if r["length"] == length and r.get("variant") == variant and r.get("load_job_us"))


def fmt_rates(rates: list[float]) -> str:
    return f"{rates[0]:.2f}" if len(rates) == 1 else f"{rates[0]:.2f}-{rates[-1]:.2f} (n={len(rates)})"
