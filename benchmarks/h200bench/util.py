"""Small helpers: JSON lines, the documents, model sizes, and host probes (mounts, free space, files)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
import uuid
from pathlib import Path
from typing import Iterator

from h200bench.settings import CHUNK, DISK_DIR_FALLBACK, WARMUP_TOKENS


def now() -> float:
    return time.time()


SOURCE_ENV = {"source": "PYKV_H200_SOURCE", "source_digest": "PYKV_H200_SOURCE_DIGEST",
              "source_commit": "PYKV_H200_SOURCE_COMMIT", "source_run": "PYKV_H200_RUN_ID"}
"""Fields every record carries when ``h200_run.sh`` set their variables: which pykv sources ran
(its label, a digest of the .py files, a snapshot's commit) and in which command (``source_report``
compares sources)."""


def emit(path: Path | str, record: dict, *, echo: bool = True) -> dict:
    """Append one JSON line (with a unique id, a timestamp and the ``SOURCE_ENV`` fields) to ``path``."""
    tags = {field: os.environ[var] for field, var in SOURCE_ENV.items() if os.environ.get(var)}
    record = {"rid": uuid.uuid4().hex[:12], "ts": round(now(), 3), **tags, **record}
    line = json.dumps(record, sort_keys=False)
    with open(path, "a") as f:
        f.write(line + "\n")
    if echo:
        print("RESULT " + line, flush=True)
    return record


def log(msg: str) -> None:
    print(f"[h200 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the workload ---------------------------------------------------------------------------------------
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


# -- host ----------------------------------------------------------------------------------------------
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


def mounts() -> Iterator[dict]:
    """The mounts of this process: mount point, fs type and source, from /proc/self/mountinfo."""
    try:
        lines = open("/proc/self/mountinfo").read().splitlines()
    except OSError:
        return
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 2:
            continue
        yield {"mountpoint": fields[4].replace("\\040", " "), "fstype": rfields[0], "source": rfields[1]}


def mount_of(path: str) -> dict:
    """Mount point, fs type and source of the file system holding ``path``."""
    real = os.path.realpath(path)
    best = {"mountpoint": "/", "fstype": "?", "source": "?"}
    for mount in mounts():
        mp = mount["mountpoint"]
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best["mountpoint"]):
            best = mount
    return best


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def pick_disk_dir() -> str:
    """A directory on the block-device file system with the most free space (the virtio disk)."""
    best, best_free = DISK_DIR_FALLBACK, -1
    for mount in mounts():
        if mount["fstype"] not in ("ext4", "xfs", "btrfs", "ext3"):
            continue
        if not mount["source"].startswith("/dev/") or mount["source"].startswith("/dev/loop"):
            continue
        candidate = DISK_DIR_FALLBACK if mount["mountpoint"] == "/" else mount["mountpoint"]
        try:
            if not os.access(candidate, os.W_OK):
                continue
            free = free_bytes(candidate)
        except OSError:
            continue
        if free > best_free:
            best, best_free = candidate, free
    return best


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


def numa_layout() -> dict:
    """The host's NUMA nodes (their CPU lists) and each GPU's node, from sysfs ({} where absent):
    staging memory, the loop devices' tmpfs pages and the GPU may sit on different nodes."""
    layout: dict = {}
    nodes = Path("/sys/devices/system/node")
    for node in sorted(nodes.glob("node[0-9]*")):
        try:
            layout.setdefault("nodes", {})[node.name] = (node / "cpulist").read_text().strip()
        except OSError:
            continue
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*")):
        try:
            if (dev / "vendor").read_text().strip() == "0x10de" and (dev / "class").read_text().startswith("0x03"):
                layout.setdefault("gpus", {})[dev.name] = (dev / "numa_node").read_text().strip()
        except OSError:
            continue
    return layout


def read_pass_result(size: int, count: int, started: float, ends: list[float]) -> dict:
    """A read pass over ``count`` devices of ``size`` bytes each, begun at ``started`` and ended per device
    at ``ends`` (``perf_counter``): aggregate and per-device GB/s."""
    wall, total = max(ends) - started, size * count
    return {"bytes": total, "seconds": round(wall, 4), "gb_per_s": round(total / wall / 1e9, 3),
            "per_device_gb_per_s": [round(size / (end - started) / 1e9, 3) for end in ends]}


def close_pass(fds: list[int], backend, pool) -> None:
    """Close a read pass's files, I/O backend (None: never opened) and staging pool."""
    for fd in fds:
        os.close(fd)
    if backend is not None:
        backend.close()
    pool.close()
