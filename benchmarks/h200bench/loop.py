"""Loop devices in a tmpfs (an emulated fast NVMe), and room in that tmpfs.

Images live in ``shm`` (``--shm``), mounts on ``mount_base/pykv-h200-NAME`` (``--mount-base``);
each device's state is kept in ``WORK/loop-NAME.json`` so a later command can tear it down.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable

from h200bench.settings import GIB, NATIVE_REGION_DIR
from h200bench.util import free_bytes, log, mount_of, run_cmd


class LoopDevices:
    def __init__(self, work: Path, *, shm: str, mount_base: str, dry: bool, smoke: bool,
                 record: Callable[[dict], None]) -> None:
        self.work, self.shm, self.mount_base = work, shm, mount_base
        self.dry, self.smoke, self.record = dry, smoke, record

    def setup(self, name: str, size: int, *, stage: str, extra_shm: int = 0) -> str:
        """A fresh ext4 loop device of ``size`` bytes (every earlier one torn down); its mount point."""
        if self.dry:
            return self.make(name, size, stage=stage)
        self.teardown_all()
        self.ensure_shm(size + extra_shm)
        return self.make(name, size, stage=stage)

    def ensure(self, name: str, size: int, *, stage: str) -> str:
        """Loop device ``name``: the one a previous command of this lease left mounted, else a fresh one
        (a sparse image of ``size`` bytes, mounted with ``discard`` so deleted files give their memory
        back to the tmpfs); other devices are left alone. One smaller than ``size`` (an earlier
        command's, for fewer documents) is torn down and made again. Its mount point."""
        state_file = self.work / f"loop-{name}.json"
        if not self.dry and state_file.exists():
            state = json.loads(state_file.read_text())
            if (os.path.ismount(state["mnt"]) and os.path.exists(state["img"])
                    and os.path.getsize(state["img"]) >= size):
                self.record({"kind": "env", "stage": stage, "what": "loop", **state, "reused": True,
                             "mount": mount_of(state["mnt"])})
                log(f"loop {name}: reusing {state['dev']} on {state['mnt']}")
                return state["mnt"]
            self.teardown(state_file)
        return self.make(name, size, stage=stage, discard=True, bytes_per_inode=1 << 20)

    def make(self, name: str, size: int, *, stage: str, discard: bool = False, bytes_per_inode: int = 0) -> str:
        """Image, loop device, ext4 and mount for ``name`` (nothing checked or torn down first)."""
        mnt = f"{self.mount_base}/pykv-h200-{name}"
        img = f"{self.shm}/pykv-h200-{name}.img"
        if self.dry:
            print(f"  loop: {size / GIB:.0f} GiB image {img} -> ext4 on {mnt}")
            return mnt
        if size < 64 << 20:  # run 12: P40 gave the native tier's image the bytes its tree reset removed (0)
            raise ValueError(f"loop {name}: an image of {size} bytes asked for (at least 64 MiB)")
        run_cmd(["truncate", "-s", str(size), img])
        dev = run_cmd(["losetup", "-f", "--show", img]).stdout.strip()
        state = {"name": name, "img": img, "dev": dev, "mnt": mnt}
        (self.work / f"loop-{name}.json").write_text(json.dumps(state))
        mkfs = ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"]
        run_cmd(mkfs + (["-i", str(bytes_per_inode)] if bytes_per_inode else []) + [dev])
        os.makedirs(mnt, exist_ok=True)
        run_cmd(["mount"] + (["-o", "discard"] if discard else []) + [dev, mnt])
        self.record({"kind": "env", "stage": stage, "what": "loop", **state, "size": size, "discard": discard,
                     "mount": mount_of(mnt)})
        log(f"loop {name}: {dev} ({size / GIB:.0f} GiB in {img}) mounted on {mnt}")
        return mnt

    def device(self, name: str) -> str:
        """The /dev/loopN of loop device ``name``."""
        return json.loads((self.work / f"loop-{name}.json").read_text())["dev"]

    def teardown_all(self, prefix: str = "") -> None:
        """Every loop device this work dir made (or those whose name starts with ``prefix``)."""
        for f in sorted(self.work.glob(f"loop-{prefix}*.json")):
            self.teardown(f)

    def teardown(self, state_file: Path) -> None:
        """Unmount, detach and delete the image of the device ``state_file`` describes."""
        state = json.loads(state_file.read_text())
        for _ in range(5):
            if run_cmd(["umount", state["mnt"]], check=False).returncode == 0 or not os.path.ismount(state["mnt"]):
                break
            time.sleep(1.0)
        run_cmd(["losetup", "-d", state["dev"]], check=False)
        try:
            os.unlink(state["img"])
        except FileNotFoundError:
            pass
        state_file.unlink()
        log(f"loop {state['name']}: torn down")

    @staticmethod
    def trim(mnt: str) -> None:
        """Give the blocks of deleted files back to the tmpfs now (``fstrim``; best effort)."""
        run_cmd(["fstrim", mnt], check=False)

    def ensure_shm(self, need: int) -> None:
        """Make room in the tmpfs (loop images; vLLM's native CPU tier maps its region there too)."""
        if self.dry or self.smoke:
            return
        self.clean_shm()
        free = free_bytes(self.shm)
        if free < need + 2 * GIB:
            st = os.statvfs(self.shm)
            used = st.f_blocks * st.f_frsize - free
            want = math.ceil((used + need + 4 * GIB) / GIB)
            log(f"{self.shm} has {free / GIB:.1f} GiB free, {need / GIB:.1f} GiB needed: remount size={want}G")
            run_cmd(["mount", "-o", f"remount,size={want}G", self.shm], check=False)

    @staticmethod
    def clean_shm() -> None:
        """Remove native-tier regions that a killed engine of ours left (no engine runs now)."""
        for f in Path(NATIVE_REGION_DIR).glob("vllm_offload_*.mmap"):
            try:
                f.unlink()
                log(f"removed stale {f}")
            except OSError:
                pass


def image_bytes(tree: int, *, headroom: float = 1.15) -> int:
    """A loop image for a tree of ``tree`` bytes: ``headroom`` times it plus 2 GiB, whole GiB."""
    return math.ceil((int(tree * headroom) + 2 * GIB) / GIB) * GIB
