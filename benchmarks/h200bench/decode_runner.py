"""Stage I of ``h200_decode.py`` (issue 19, no collateral damage): long decodes while a stream of
long prompts is stored and loaded in the background; one engine per configuration (no connector,
pykv with preloading, vLLM's native tiering), each over a tree of its own."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess

from h200bench.decode_workload import GPU_LONG_LENGTHS, SMOKE_LONG_LENGTHS, miss_tokens
from h200bench.loop import image_bytes
from h200bench.runner import BENCHMARKS, Runner
from h200bench.settings import CHUNK, GIB
from h200bench.util import drop_caches, log, tree_bytes

DECODE_ENTRY = BENCHMARKS / "h200_decode.py"
SYSTEMS = ("none", "pykv", "native")
ENGINE_S = 100
"""Seconds one engine process of this stage takes on the H200 host, roughly (start, work, exit)."""


class DecodeRunner(Runner):
    """h200_connector's runner (loop device, settings, spawning) with stage I."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        smoke = self.smoke
        self.long_lengths = [int(x) for x in a.long_lengths.split(",")] if a.long_lengths else \
            list(SMOKE_LONG_LENGTHS if smoke else GPU_LONG_LENGTHS)
        self.lengths = list(self.long_lengths)  # the fill engines store one document (or --itl-docs) of each
        self.docs = self.loop_docs = a.itl_docs
        self.long_requests = a.long_requests or (6 if smoke else 12)
        self.long_gap_s = a.long_gap_s if a.long_gap_s is not None else (0.5 if smoke else 1.0)
        self.decode_seqs = a.decode_seqs
        self.decode_prompt = a.decode_prompt or (64 if smoke else 512)
        self.decode_max_tokens = a.decode_max_tokens or (1500 if smoke else 6000)
        self.tail_tokens = a.tail_tokens if a.tail_tokens is not None else (16 if smoke else 64)
        self.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad:
            raise SystemExit(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")

    def engine_kwargs(self) -> dict:
        kw = super().engine_kwargs()
        kw["max_model_len"] = max(kw["max_model_len"], self.decode_prompt + self.decode_max_tokens + CHUNK)
        if self.smoke:
            kw.update(max_num_batched_tokens=512, gpu_memory_utilization=0.1)  # 8 decodes beside the stream
        return kw

    def tier_bytes(self) -> int:
        """pykv's DRAM tier and the native CPU tier in the measured engines (the same for both)."""
        if self.smoke:
            return 64 << 20
        return int((self.a.itl_dram_gib or self.fs_cpu_gib()) * GIB)

    def tree_need(self) -> int:
        """Bytes a system's tree reaches: the fill, the stream's fresh prompts, the decodes."""
        kv = self.info()["kv_bytes_per_token"]
        chunks = miss_tokens(self.long_lengths, self.long_requests) // CHUNK + \
            self.decode_seqs * ((self.decode_prompt + self.decode_max_tokens) // CHUNK + 1)
        return tree_bytes(self.lengths, self.docs, kv) + chunks * (CHUNK * kv + 8192)

    def medium(self, name: str, extra_shm: int = 0) -> tuple[str, str]:
        """(directory, medium) for a system's tree: a fresh loop device in the tmpfs, else the disk
        directory (no loop device: not root, no losetup), or the work dir in ``--cpu-smoke``."""
        if self.smoke:
            path = self.work / "smoke-itl" / name
            shutil.rmtree(path, ignore_errors=True)
            return str(path), "smoke"
        try:
            return self.loop_setup(name, image_bytes(self.tree_need(), headroom=2), extra_shm=extra_shm), "loop"
        except (subprocess.CalledProcessError, OSError) as exc:
            path = os.path.join(self.disk_dir, name)
            log(f"loop device for {name} not available ({exc!r}); the tree goes to {path}")
            shutil.rmtree(path, ignore_errors=True)
            return path, "virtio"

    def enough_time(self, label: str, engines: int) -> bool:
        """Whether ``engines`` more engine processes fit before the deadline; else a ``skipped`` record."""
        need = engines * ENGINE_S
        if self.dry or self.remaining() >= need:
            return True
        log(f"{label}: skipped ({self.remaining():.0f} s left, {need} s needed)")
        self.record({"kind": "skipped", "stage": self.stage, "label": label, "why": "time"})
        return False

    def itl(self, label: str, *, system: str, medium: str, ktc: dict | None) -> int:
        """One measured engine (``decode_engine.itl_main``): the decodes and the stream."""
        info = self.info()
        raw = self.work / "itl" / f"{label}.json"
        cfg = {"stage": self.stage, "label": label, "system": system, "medium": medium,
               "results": str(self.results), "engine_kwargs": self.engine_kwargs(), "ktc": ktc,
               "vocab": info["vocab"], "long_lengths": self.long_lengths, "long_requests": self.long_requests,
               "long_gap_s": self.long_gap_s, "docs": self.docs, "decode_seqs": self.decode_seqs,
               "decode_prompt": self.decode_prompt, "decode_max_tokens": self.decode_max_tokens,
               "tail_tokens": self.tail_tokens, "lead_tokens": 8, "lead_timeout_s": 120,
               "raw": str(raw), "stats": str(self.work / "stats" / label) if system == "pykv" else None}
        if self.dry:
            extra = (ktc or {}).get("kv_connector_extra_config", {})
            keys = {k: extra[k] for k in ("dram_bytes", "cpu_bytes_to_use", "preload", "store", "root",
                                          "secondary_tiers") if k in extra}
            print(f"  itl {label}: {system} on {medium}: {self.decode_seqs} decodes ({self.decode_prompt} "
                  f"tokens, up to {self.decode_max_tokens} out), {self.long_requests} long prompts "
                  f"{self.long_lengths} every {self.long_gap_s} s, half stored {keys}")
            if ktc:
                print(f"    kv_transfer_config: {json.dumps(ktc)}")
            return 0
        raw.parent.mkdir(parents=True, exist_ok=True)
        rc = self.spawn_config(label, "itl", cfg, 360, script=DECODE_ENTRY)
        if self.out and raw.exists():
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(raw, self.out / raw.name)
        return rc

    def drop(self) -> None:
        if not self.dry:
            self.record({"kind": "drop_caches", "stage": self.stage, "ok": drop_caches()})

    def stage_I(self) -> None:
        self.phase_env()
        log(f"stage I: {self.decode_seqs} decodes; {self.long_requests} long prompts of {self.long_lengths} "
            f"tokens every {self.long_gap_s} s (even: stored documents, odd: fresh); systems {self.systems}")
        if "none" in self.systems and self.enough_time("itl-none", 1):
            self.itl("itl-none", system="none", medium="-", ktc=None)
        if "pykv" in self.systems and self.enough_time("itl-pykv", 2):
            self.pykv()
        if "native" in self.systems:
            if self.smoke:
                log("stage I: native skipped in --cpu-smoke (vLLM's native tiers refuse the CPU platform)")
            elif self.enough_time("itl-native", 2):
                self.native()

    def pykv(self) -> None:
        """Fill engine (the stream's documents, DRAM tier 0), page cache dropped, measured engine
        with the harness's pykv settings, preloading and stores on."""
        path, medium = self.medium("itl-pykv")
        try:
            root = os.path.join(path, "pykv-tree")
            fill = self.engine("itl-pykv-fill", system="pykv", medium=medium, variant="fill",
                               steps=[{"op": "fill"}, {"op": "settle", "timeout": 300}],
                               ktc=self.pykv_ktc(root, dram_bytes=0, verify="header"), stats=True)
            if fill != 0:
                log("itl-pykv: fill failed; measured engine skipped")
                return
            self.drop()
            ktc = self.pykv_ktc(root, dram_bytes=self.tier_bytes(), verify="full")  # pykv config's verify
            ktc["kv_connector_extra_config"].update(preload=True, store=True)
            self.itl("itl-pykv", system="pykv", medium=medium, ktc=ktc)
        finally:
            self.release(path, medium)

    def native(self) -> None:
        """vLLM's native fs tier under a CPU tier: fill engine, page cache dropped, measured engine
        with a CPU tier as large as pykv's DRAM tier."""
        path, medium = self.medium("itl-native", extra_shm=max(self.tier_bytes(), int(self.fs_cpu_gib() * GIB)))
        try:
            fs_root = os.path.join(path, "kvfs")
            fill = self.engine("itl-native-fill", system="native_fs", medium=medium, variant="fill",
                               steps=[{"op": "fill"}, {"op": "settle", "seconds": 20.0}],
                               ktc=self.native_ktc(fs_root))
            if fill != 0:
                log("itl-native: fill failed; measured engine skipped")
                return
            self.drop()
            ktc = self.native_ktc(fs_root)
            ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] = self.tier_bytes()
            self.itl("itl-native", system="native", medium=medium, ktc=ktc)
        finally:
            self.release(path, medium)

    def release(self, path: str, medium: str) -> None:
        """The system's tree goes: its loop device, or its directory on the disk (unless --keep-trees)."""
        if self.dry:
            return
        if medium == "loop":
            self.loops.teardown_all()
        elif medium == "virtio" and not self.a.keep_trees:
            shutil.rmtree(path, ignore_errors=True)
