"""Which mount a directory lies on: its file-system type, source and options (``/proc/self/mountinfo``).

``pykv doctor`` names the file system it probed and warns about mount options that
change what pykv relies on (a read-only mount, NFS without close-to-open consistency).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"
MOUNTINFO_MAX = 8 << 20  # bytes read at most (tens of thousands of mounts)
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mountinfo``: where, what and how a file system is mounted."""

    mount_point: str
    fstype: str  # "ext4", "nfs4", "fuse.juicefs", "lustre", "ceph", ...
    source: str
    options: tuple[str, ...]  # per-mount options (rw, relatime, ...)
    super_options: tuple[str, ...]  # the file system's own (NFS: vers, actimeo, lookupcache, ...)
    mount_id: int = -1
    device: str = ""  # "major:minor" of the file system
    root: str = "/"  # the directory of that file system mounted here ("/dir" for a bind mount of a dir)

    def option(self, name: str) -> str | None:
        """The value of ``name`` (``""`` for a flag such as ``ro``) in either option list; None if absent."""
        for option in self.options + self.super_options:
            key, sep, value = option.partition("=")
            if key == name:
                return value if sep else ""
        return None

    @property
    def network(self) -> bool:
        """True for file systems shared between nodes (NFS, Lustre, CephFS, a FUSE client, ...)."""
        return self.fstype.split(".")[0] in ("nfs", "nfs4", "lustre", "ceph", "fuse", "cifs", "smb3", "gpfs",
                                             "beegfs", "glusterfs", "9p", "virtiofs")


def _unescape(field: str) -> str:
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``mountinfo`` text; lines that do not parse are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        if len(fields) < dash + 3:
            continue
        mounts.append(Mount(mount_point=_unescape(fields[4]), fstype=fields[dash + 1], source=_unescape(fields[dash + 2]),
                            options=tuple(fields[5].split(",")),
                            super_options=tuple(fields[dash + 3].split(",")) if len(fields) > dash + 3 else (),
                            mount_id=int(fields[0]) if fields[0].isdecimal() else -1, device=fields[2],
                            root=_unescape(fields[3])))
    return mounts


def read_mounts(mountinfo: str = MOUNTINFO) -> list[Mount] | None:
    """The mounts ``mountinfo`` lists (at most ``MOUNTINFO_MAX`` bytes read); None where it cannot be read."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as info:
            return parse_mountinfo(info.read(MOUNTINFO_MAX))
    except OSError:
        return None


def mount_of(directory: str | os.PathLike[str], mountinfo: str = MOUNTINFO, *, resolve: bool = True) -> Mount | None:
    """The mount holding ``directory`` (the last-mounted one at the longest matching mount point);
    None where ``mountinfo`` cannot be read. ``resolve=False``: the absolute path as written, without
    asking the file system (which a stalled mount would never answer)."""
    mounts = read_mounts(mountinfo)
    if mounts is None:
        return None
    real = os.path.realpath(directory) if resolve else os.path.abspath(directory)
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            best = mount
    return best
