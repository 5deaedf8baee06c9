"""``pykv doctor``'s stall checks: does the mount answer at all, how fast, and what it does when
its server goes away.

A stalled mount (a dead NFS server on a ``hard`` mount, a hung Lustre OST, a stopped FUSE
daemon) blocks every call that reaches it, doctor's own probes included. So the first check
runs the calls pykv's lookups make (``stat`` and ``statvfs`` of the root, ``lstat`` of block
names) on a daemon thread with a time limit: a mount that does not answer within it is a
``fail`` and doctor probes nothing else there. The latency of the lookups is compared with
``lookup_deadline``'s default; the mount's type and options say how an outage will look.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path

from pykv.config import PykvConfig
from pykv.io.mounts import Mount
from pykv.maintenance.diagnosis import Diagnosis, Verdict
from pykv.treenames import BLOCK_SUFFIX
from pykv.units import parse_duration

RESPONSE_TIMEOUT_S = 10.0
LOOKUP_SAMPLES = 64
SLOW_FRACTION = 0.25
"""A lookup slower than this fraction of the default lookup_deadline is a warning (misses ahead)."""
DEFAULT_LOOKUP_DEADLINE_S = parse_duration(PykvConfig.__dataclass_fields__["lookup_deadline"].default)


def check_responsive(root: Path, timeout: float = RESPONSE_TIMEOUT_S) -> Diagnosis:
    """Run the lookups' calls on ``root`` on a daemon thread within ``timeout``; ``fail`` when the
    mount does not answer (the thread is left blocked: nothing else can be done for it)."""
    progress = {"step": "stat of the root", "latencies": []}
    finished = threading.Event()
    errors: list[OSError] = []

    def probe() -> None:
        try:
            os.stat(root)
            progress["step"] = "statvfs of the root"
            os.statvfs(root)
            for _ in range(LOOKUP_SAMPLES):
                progress["step"] = "lstat of a block name"
                name = root / f"{secrets.token_hex(16)}{BLOCK_SUFFIX}"
                began = time.perf_counter()
                try:
                    os.lstat(name)
                except FileNotFoundError:
                    pass
                progress["latencies"].append(time.perf_counter() - began)
        except OSError as exc:
            errors.append(exc)
        finally:
            finished.set()

    threading.Thread(target=probe, name="pykv-doctor-stall", daemon=True).start()
    if not finished.wait(timeout):
        return Diagnosis("responsive", Verdict.FAIL,
                         f"{progress['step']} did not answer within {timeout:.0f} s: the mount is stalled (engines "
                         f"count its blocks as misses after lookup_deadline and give up its I/O after io_deadline); "
                         f"no other probe runs")
    if errors:  # a missing root or a file: the tree check names it
        return Diagnosis("responsive", Verdict.SKIP, f"{progress['step']} failed: {errors[0].strerror or errors[0]}")
    return _latency(progress["latencies"])


def _latency(latencies: list[float]) -> Diagnosis:
    ordered = sorted(latencies)
    median, worst = ordered[len(ordered) // 2], ordered[-1]
    line = f"{len(ordered)} lookups of absent block names: median {median * 1e3:.2f} ms, slowest {worst * 1e3:.2f} ms"
    if worst > SLOW_FRACTION * DEFAULT_LOOKUP_DEADLINE_S:
        return Diagnosis("responsive", Verdict.WARN, f"{line}: close to lookup_deadline "
                                                     f"({DEFAULT_LOOKUP_DEADLINE_S:g} s by default); slower lookups "
                                                     "are misses, raise it for this mount")
    return Diagnosis("responsive", Verdict.OK, line)


def stall_behaviour(mount: Mount | None) -> Diagnosis:
    """What an outage of this mount's server does to pykv's calls, from its type and options."""
    if mount is None:
        return Diagnosis("stall_behaviour", Verdict.SKIP, "file system unknown")
    kind = mount.fstype
    if kind.startswith("nfs"):
        if mount.option("soft") is not None or mount.option("softerr") is not None:
            timeo = mount.option("timeo") or "?"
            return Diagnosis("stall_behaviour", Verdict.OK,
                             f"soft NFS mount (timeo={timeo}): a server outage fails calls with EIO/ETIMEDOUT after "
                             "its retries; pykv counts those blocks as misses (a write publishes whole or not at "
                             "all)")
        return Diagnosis("stall_behaviour", Verdict.WARN,
                         "hard NFS mount: a server outage blocks every call until the server returns; engines "
                         "answer such blocks as misses after lookup_deadline and give up loads and stores after "
                         "io_deadline, but each blocked read keeps its staging slot until then")
    if kind.startswith("fuse"):
        return Diagnosis("stall_behaviour", Verdict.WARN,
                         f"{kind}: a hung or stopped FUSE daemon blocks every call that reaches it; engines answer "
                         "such blocks as misses after lookup_deadline and give up loads and stores after io_deadline")
    if kind in ("lustre", "ceph", "gpfs", "beegfs", "glusterfs", "9p", "cifs", "smb3"):
        return Diagnosis("stall_behaviour", Verdict.WARN,
                         f"{kind} is a network file system: a server outage can block calls for minutes; engines "
                         "bound it with lookup_deadline and io_deadline")
    return Diagnosis("stall_behaviour", Verdict.OK, f"{kind} is local: calls block only as long as the device does")
