"""Stages P40, P80 (a burst of long requests with preloading on and off, and vLLM's native fs
tier) and R (round-robin multi-turn beyond the DRAM tier) of ``h200_preload.py``."""

from __future__ import annotations

import argparse
import os

from h200bench.loop import image_bytes
from h200bench.preload_workload import STAGE_LENGTHS, remove_new_files, tree_files
from h200bench.runner import BENCHMARKS, Runner
from h200bench.settings import GIB
from h200bench.util import drop_caches, log, tree_bytes

PRELOAD_ENTRY = BENCHMARKS / "h200_preload.py"


class PreloadRunner(Runner):
    """h200_connector's runner (loop device, settings, spawning) with burst stages."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.requests = 12 if self.smoke else a.requests
        self.concurrency = 4 if self.smoke else a.concurrency
        self.burst_docs = 2 if self.smoke else a.burst_docs

    def engine_kwargs(self) -> dict:
        kw = super().engine_kwargs()
        if self.a.max_num_seqs:  # requests beyond it wait in vLLM's queue: the wait preloading can use
            kw["max_num_seqs"] = self.a.max_num_seqs
        if self.smoke:
            kw.update(max_num_batched_tokens=512, gpu_memory_utilization=0.05)
        return kw

    def burst(self, label: str, *, system: str, variant: str, ktc: dict | None, length: int,
              stats: bool) -> int:
        info = self.info()
        cfg = {"stage": self.stage, "label": label, "system": system, "variant": variant,
               "results": str(self.results), "engine_kwargs": self.engine_kwargs(), "ktc": ktc, "length": length,
               "requests": self.requests, "concurrency": self.concurrency, "docs": self.burst_docs,
               "vocab": info["vocab"], "kv_bytes_per_token": info["kv_bytes_per_token"],
               "stats": str(self.work / "stats" / label) if stats else None}
        if self.dry:
            extra = (ktc or {}).get("kv_connector_extra_config", {})
            tiers = {k: extra[k] for k in ("dram_bytes", "cpu_bytes_to_use", "preload", "preload_max_bytes")
                     if k in extra}
            print(f"  burst {label}: {system}/{variant} L={length} requests={self.requests} "
                  f"concurrency={self.concurrency} docs={self.burst_docs} {tiers}")
            return 0
        return self.spawn_config(label, "burst", cfg, 540, script=PRELOAD_ENTRY)

    def burst_dram_bytes(self) -> int:
        """pykv's DRAM tier in the query engines: what the native fs engine gets as its CPU tier
        (``--query-dram-gib``, or by default the fill's CPU tier, which holds every document)."""
        if self.smoke:
            return 64 << 20
        return int((self.a.query_dram_gib or self.fs_cpu_gib()) * GIB)

    def stage_burst(self, length: int) -> None:
        self.phase_env()
        self.lengths = [length]  # the fill engines store documents of this length ...
        self.loop_docs = self.burst_docs  # ... this many (sizes the native tier's CPU region too)
        info = self.info()
        need = tree_bytes([length], self.burst_docs, info["kv_bytes_per_token"])
        size = image_bytes(need)
        mnt = self.loop_setup("preload", size) if not self.smoke else str(self.work / "smoke")
        tag = f"{length // 1024}k"
        try:
            root = os.path.join(mnt, "pykv-tree")
            # the floor's measurements (preload_floor), on the empty device: its O_DIRECT rate, and H2D
            self.bw("loop", os.path.join(mnt, "bw"), h2d=not self.smoke, files=False)
            fill = self.engine(f"preload-{tag}-pykv-fill", system="pykv", medium="loop", variant="fill",
                               steps=[{"op": "fill"}, {"op": "settle", "timeout": 300}],
                               ktc=self.pykv_ktc(root, dram_bytes=0, verify="header"), stats=True,
                               docs=self.burst_docs)
            if fill == 0:
                filled = tree_files(root) if not self.dry else set()
                for variant in ("preload-on", "preload-off"):
                    if not self.dry:
                        # each query engine starts from the tree the fill left: the misses the first
                        # one stored would otherwise fill the disk before the second runs (run 6b:
                        # preload on stored 5 GB of them, preload off found the disk full)
                        files, removed = remove_new_files(root, filled)
                        self.record({"kind": "tree_reset", "stage": self.stage, "variant": variant,
                                     "removed_files": files, "removed_bytes": removed})
                        self.record({"kind": "drop_caches", "stage": self.stage, "ok": drop_caches()})
                    # the same DRAM as the native tier's CPU tier in front of its fs tier (run 4 gave pykv
                    # none and it re-read every reused document from disk: benchmarks/results/history/13-preloading-runs-4-5.md)
                    ktc = self.pykv_ktc(root, dram_bytes=self.burst_dram_bytes(), verify="header")
                    extra = ktc["kv_connector_extra_config"]
                    extra["preload"] = variant == "preload-on"
                    if self.a.query_no_store:  # run 7: the misses' stores filled the disk mid-burst
                        extra["store"] = False
                    if not any(item.startswith("preload_max_bytes") for item in self.a.pykv_set or []):
                        # runs 4 and 5 kept the 256M default: 9 blocks of 28 MiB, 2.3k of a waiting
                        # request's 40k tokens, so at most 6 % of a hit could be read ahead
                        extra["preload_max_bytes"] = int(extra["staging_bytes"]) // 2
                    self.burst(f"preload-{tag}-pykv-{variant}", system="pykv", variant=variant, ktc=ktc,
                               length=length, stats=True)
            if self.smoke:
                return
            self.loops.teardown_all()  # room for the native tier's own image
            mnt = self.loop_setup("preload-fs", size, extra_shm=int(self.fs_cpu_gib() * GIB))
            fs_root = os.path.join(mnt, "kvfs")
            fill = self.engine(f"preload-{tag}-native-fill", system="native_fs", medium="loop", variant="fill",
                               steps=[{"op": "fill"}, {"op": "settle", "seconds": 20.0}],
                               ktc=self.native_ktc(fs_root), docs=self.burst_docs)
            if fill == 0:
                if not self.dry:
                    self.record({"kind": "drop_caches", "stage": self.stage, "ok": drop_caches()})
                ktc = self.native_ktc(fs_root)
                ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] = self.burst_dram_bytes()
                self.burst(f"preload-{tag}-native", system="native_fs", variant="", ktc=ktc, length=length,
                           stats=False)
        finally:
            if not self.dry and not self.smoke:
                self.loops.teardown_all()

    def stage_R(self) -> None:
        """Round-robin multi-turn beyond the DRAM tier: pykv (preload on) and native tiering,
        each on its own fresh loop device; disk bytes read against bytes delivered."""
        self.phase_env()
        a, info = self.a, self.info()
        conversations, turns = (3, 3) if self.smoke else (a.conversations, a.turns)
        base, step = (512, 256) if self.smoke else (a.turn_base, a.turn_step)
        kv = info["kv_bytes_per_token"]
        working = conversations * (base + (turns - 1) * step) * kv
        dram = (1 << 20) * 3 if self.smoke else int(a.rr_dram_gib * GIB)
        # 2x the working set: vLLM 0.26's native fs tier filled a 1.3x image and died (run 6b, ENOSPC)
        size = image_bytes(working, headroom=2)
        common = {"stage": self.stage, "results": str(self.results), "engine_kwargs": self.engine_kwargs(),
                  "vocab": info["vocab"], "kv_bytes_per_token": kv, "conversations": conversations, "turns": turns,
                  "turn_base": base, "turn_step": step, "concurrency": self.concurrency, "dram_bytes": dram,
                  "working_set_bytes": working}
        log_line = (f"stage R: {conversations} conversations x {turns} turns, {base}+{step}/turn tokens, "
                    f"working set {working / GIB:.1f} GiB, DRAM tier {dram / GIB:.2f} GiB")
        log(log_line)
        for system in ("pykv", "native_fs"):
            mnt = self.loop_setup(f"rr-{system}", size, extra_shm=dram) if not self.smoke \
                else str(self.work / "smoke-rr" / system)
            try:
                label = f"rr-{system}"
                if system == "pykv":
                    ktc = self.pykv_ktc(os.path.join(mnt, "pykv-tree"), dram_bytes=dram, verify="header")
                    ktc["kv_connector_extra_config"]["preload"] = True
                    staging = ktc["kv_connector_extra_config"].get("staging_bytes")
                else:
                    if self.smoke:
                        continue  # vLLM's native tiers need CUDA
                    ktc, staging = self.native_ktc(os.path.join(mnt, "kvfs")), None
                    ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] = dram
                dev = None if self.smoke or self.dry else self.loops.device(f"rr-{system}")
                cfg = {**common, "label": label, "system": system, "ktc": ktc, "loop_dev": dev,
                       "staging_bytes": staging, "stats": str(self.work / "stats" / label) if system == "pykv" else None}
                if self.dry:
                    print(f"  turns {label}: DRAM {dram} bytes, loop image {size / GIB:.0f} GiB")
                    continue
                self.spawn_config(label, "turns", cfg, 420, script=PRELOAD_ENTRY)
            finally:
                if not self.dry and not self.smoke:
                    self.loops.teardown_all()

    def stage_P40(self) -> None:
        self.stage_burst(512 * 3 if self.smoke else STAGE_LENGTHS["P40"])

    def stage_P80(self) -> None:
        self.stage_burst(512 * 5 if self.smoke else STAGE_LENGTHS["P80"])
