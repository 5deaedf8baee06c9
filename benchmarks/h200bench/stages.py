"""Stages A, B, C, D, L, M (and K, ``calibrate_stage``) of ``h200_connector.py stage``.

A: O_DIRECT (virtio) and pinned H2D bandwidth; recompute; native CPU tier.
B: pykv on the virtio disk: fill engine, page cache dropped, fresh engine: disk hit then DRAM
   hit per document; again with verify="full".
C: pykv on a loop device in the tmpfs: O_DIRECT bandwidth, then as B.
D: vLLM's native fs tier (TieringOffloadingSpec) on a loop device: fill, page cache dropped, query.
M: DRAM hits side by side: native CPU tier, then pykv with a DRAM tier (one engine: fill, then
   two DRAM-served queries per document).
L: loop device bandwidth sweep: request sizes, depths, split reactor reads.
S1, S2, S3: several loop devices as one pykv cache (``striping``).
T, T1, T2: pykv at tensor parallelism ``--tp`` against recompute and the native fs tier (``tp_stage``).
LM: LMCache 0.5.3's local_disk backend on a loop device (``lmcache_stage``).
"""

from __future__ import annotations

import os
import shutil

from h200bench import auth_stage, calibrate_stage, lmcache_stage, striping, tp_stage, verify_stage
from h200bench.loop import image_bytes
from h200bench.runner import Runner
from h200bench.settings import CHUNK, GIB, WARMUP_TOKENS
from h200bench.util import count_files, drop_caches, free_bytes, log, tree_bytes


class StageRunner(Runner):
    # -- phases -------------------------------------------------------------------------------------
    def phase_recompute(self) -> None:
        self.engine("recompute", system="recompute", medium=None, variant="",
                    steps=[{"op": "query", "phases": ["query"]}], ktc=None)

    def phase_native_cpu(self) -> None:
        if self.smoke:
            log("native CPU tier: skipped (vLLM's CPU tier refuses the CPU platform)")
            return
        self.loops.ensure_shm(int(self.a.cpu_gib * GIB))
        self.engine("native-cpu", system="native_cpu", medium=None, variant="",
                    steps=[{"op": "fill"}, {"op": "settle", "seconds": 3.0}, {"op": "query", "phases": ["query"]}],
                    ktc=self.native_ktc())

    def dram_tier_bytes(self, tree: int) -> int:
        """pykv's DRAM tier in a query engine: the tree and 10 % (at most ``--dram-max-gib``)."""
        return 64 << 20 if self.smoke else min(int(tree * 1.1) + GIB, int(self.a.dram_max_gib * GIB))

    def pykv_phases(self, medium: str, base: str, docs: int) -> None:
        """pykv fill engine, then per verify mode: page cache dropped, a fresh query engine."""
        root = os.path.join(base, "pykv-tree")
        need = tree_bytes(self.lengths, docs, self.info()["kv_bytes_per_token"])
        dram = self.dram_tier_bytes(need)
        if not self.dry:
            shutil.rmtree(root, ignore_errors=True)
            if free_bytes(base) < need * 1.05:
                log(f"WARNING: {base} has {free_bytes(base) / 1e9:.1f} GB free, the fill needs {need / 1e9:.1f} GB")
        fill = self.engine(f"pykv-{medium}-fill", system="pykv", medium=medium, variant="header",
                           steps=[{"op": "fill"}, {"op": "settle", "timeout": 300}],
                           ktc=self.pykv_ktc(root, dram_bytes=0, verify="header"), stats=True, docs=docs)
        if fill != 0:
            log(f"pykv {medium}: fill failed; query skipped")
            return
        if not self.dry:
            self.record({"kind": "tree", "stage": self.stage, "medium": medium, "root": root,
                         "files": count_files(root, ".kv"), "bytes_expected": need})
        variants = [("header", dram)] + ([("full", 0)] if self.a.verify_full else [])
        for variant, dram_bytes in variants:
            if variant != "header" and self.remaining() < self.a.optional_min_s + self.reserve:
                log(f"pykv {medium} verify={variant}: skipped ({self.remaining():.0f} s left)")
                self.record({"kind": "skipped", "stage": self.stage, "label": f"pykv-{medium}-query-{variant}",
                             "why": "time"})
                continue
            if not self.dry:
                self.record({"kind": "drop_caches", "stage": self.stage, "ok": drop_caches()})
            phases = ["query", "dram"] if dram_bytes else ["query"]
            self.engine(f"pykv-{medium}-query-{variant}", system="pykv", medium=medium, variant=variant,
                        steps=[{"op": "query", "phases": phases}],
                        ktc=self.pykv_ktc(root, dram_bytes=dram_bytes, verify=variant), stats=True, docs=docs)
        if not self.dry and not self.a.keep_trees:
            shutil.rmtree(root, ignore_errors=True)

    # -- stages -------------------------------------------------------------------------------------
    def stage_A(self) -> None:
        self.phase_env()
        self.bw("virtio", os.path.join(self.disk_dir, "bw"), h2d=True)
        self.phase_recompute()
        self.phase_native_cpu()

    def stage_B(self) -> None:
        self.phase_env()
        self.pykv_phases("virtio", self.disk_dir, self.docs)

    def stage_C(self) -> None:
        if self.smoke and not self.a.smoke_loop:
            log("stage C: skipped in --cpu-smoke (needs a loop device; --smoke-loop to try)")
            return
        mnt = self.loop_setup("pykv", image_bytes(tree_bytes(self.lengths, self.loop_docs,
                                                             self.info()["kv_bytes_per_token"])))
        try:
            self.bw("loop", os.path.join(mnt, "bw"), h2d=False)
            self.pykv_phases("loop", mnt, self.loop_docs)
        finally:
            if not self.dry:
                self.loops.teardown_all()

    def stage_D(self) -> None:
        if self.smoke:
            log("stage D: skipped in --cpu-smoke (vLLM's fs tier refuses the CPU platform)")
            return
        size = image_bytes(tree_bytes(self.lengths, self.loop_docs, self.info()["kv_bytes_per_token"]))
        mnt = self.loop_setup("fs", size, extra_shm=int(self.fs_cpu_gib() * GIB))
        root = os.path.join(mnt, "kvfs")
        expected = sum(length // CHUNK for length in self.lengths) * self.loop_docs + WARMUP_TOKENS // CHUNK
        try:
            fill = self.engine("native-fs-loop-fill", system="native_fs", medium="loop", variant="",
                               steps=[{"op": "fill"}, {"op": "settle", "files_root": root,
                                                       "files_expected": expected, "timeout": 240}],
                               ktc=self.native_ktc(root), docs=self.loop_docs)
            if fill == 0:
                if not self.dry:
                    self.record({"kind": "tree", "stage": self.stage, "medium": "loop", "root": root,
                                 "system": "native_fs", "files": count_files(root, ".bin"),
                                 "files_expected": expected})
                    self.record({"kind": "drop_caches", "stage": self.stage, "ok": drop_caches()})
                self.engine("native-fs-loop-query", system="native_fs", medium="loop", variant="",
                            steps=[{"op": "query", "phases": ["query"]}], ktc=self.native_ktc(root),
                            docs=self.loop_docs)
        finally:
            if not self.dry:
                self.loops.teardown_all()

    def stage_M(self) -> None:
        """DRAM hits only, side by side: vLLM's native CPU tier, then pykv with a DRAM tier (one engine:
        fill, which stores through DRAM slots, then two queries per document served from DRAM; the
        tree lives in the tmpfs, the loads read no file)."""
        self.phase_env()
        self.phase_native_cpu()
        root = os.path.join(self.a.shm, "pykv-h200-dram-tree")
        need = tree_bytes(self.lengths, self.docs, self.info()["kv_bytes_per_token"])
        if not self.dry:
            shutil.rmtree(root, ignore_errors=True)
            self.loops.ensure_shm(need + GIB)
        try:
            self.engine("pykv-dram", system="pykv", medium="shm", variant="header",
                        steps=[{"op": "fill"}, {"op": "settle", "timeout": 300},
                               {"op": "query", "phases": ["dram", "dram"]}],
                        ktc=self.pykv_ktc(root, dram_bytes=self.dram_tier_bytes(need), verify="header"),
                        stats=True, docs=self.docs)
        finally:
            if not self.dry:
                shutil.rmtree(root, ignore_errors=True)

    def stage_L(self) -> None:
        """Loop device bandwidth sweep only: request sizes, depths and split reactor reads."""
        if self.smoke and not self.a.smoke_loop:
            log("stage L: skipped in --cpu-smoke (needs a loop device)")
            return
        mnt = self.loop_setup("sweep", 8 * GIB)
        try:
            self.bw("loop", os.path.join(mnt, "bw"), h2d=False, sweep=True)
        finally:
            if not self.dry:
                self.loops.teardown_all()

    def stage_K(self) -> None:
        calibrate_stage.run(self)

    def stage_S1(self) -> None:
        striping.stage_s1(self)

    def stage_S2(self) -> None:
        striping.stage_s2(self)

    def stage_S3(self) -> None:
        striping.stage_s3(self)

    def stage_S4(self) -> None:
        auth_stage.stage_s4(self)

    def stage_S5(self) -> None:
        verify_stage.stage_s5(self)

    def stage_T(self) -> None:
        tp_stage.stage_t(self)

    def stage_T1(self) -> None:
        tp_stage.stage_t1(self)

    def stage_T2(self) -> None:
        tp_stage.stage_t2(self)

    def stage_LM(self) -> None:
        lmcache_stage.stage_lm(self)
