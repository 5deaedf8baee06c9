"""``pykv doctor``: probe what a mount does for pykv, one verdict per item.

Each check runs the operation pykv itself relies on, the way pykv runs it: a block is
published by hard-linking a finished temp file (a second link must fail with EEXIST and
leave the first file), gc deletes only files with one link, access recency is an
explicit ``utime`` of the atime, the engine opens, writes and reads block files through
io_uring with ``O_DIRECT`` where it can. A ``fail`` is something that breaks pykv on
this mount; a ``warn`` costs speed or needs the user's attention; ``skip`` could not be
checked from here.

Probes run only in a pykv tree or an empty directory (``ProbeRefused`` otherwise), with
files named as pykv temps of the probe (``pykv.tree.temp_name``: ``pykv fsck`` removes
what a killed doctor left), created with ``O_EXCL`` and removed again; nothing else in
the directory is touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from pathlib import Path
from typing import Callable, Mapping

from pykv.errors import InputError, MembershipError, NotATreeError
from pykv.format import FORMAT_VERSION
from pykv.io.backend import IoRequest, OpKind
from pykv.io.memory import ALIGNMENT, aligned_buffer, buffer_address
from pykv.io.mounts import Mount, mount_of
from pykv.io.openat2 import RESOLVE_NO_SYMLINKS
from pykv.io.probe import direct_io_supported
from pykv.io.safe_paths import read_small
from pykv.io.uring import UringBackend, uring_available
from pykv.maintenance.diagnosis import Diagnosis, DoctorReport, Verdict
from pykv.maintenance.evict_record import eviction_status
from pykv.maintenance.stall_check import check_responsive, stall_behaviour
from pykv.media.posix import READ_FLAGS, WRITE_FLAGS
from pykv.membership import check_membership
from pykv.roots import foreign_entries, refuse_inside_tree
from pykv.tree import MARKER_NAME, PROBE_NAME, KVTree, temp_name

SEED_ENV = "PYTHONHASHSEED"
CLOCK_SKEW_WARN_S = 30.0  # beyond this, --min-age and gc's recency are measured against a clock that is off
LOW_SPACE_FRACTION = 0.05
URING_TIMEOUT_S = 10.0
_TIME_SLACK_NS = 2_000_000_000  # coarse timestamp granularity (2 s on FAT-like file systems)


class ProbeRefused(InputError):
    """The directory holds someone else's files: doctor writes no probe into it."""


def diagnose(root: Path | str, *, environ: Mapping[str, str] | None = None) -> DoctorReport:
    """Probe ``root`` (a pykv tree or an empty directory) and return a verdict per item.

    Raises ``NotATreeError`` for a missing path or a non-directory and ``ProbeRefused`` for a
    directory holding files that are not a tree's.
    """
    root = Path(root)
    environ = os.environ if environ is None else environ
    responsive = check_responsive(root)
    if responsive.verdict is Verdict.FAIL:  # any other probe would hang on this mount too
        return DoctorReport(root, (responsive, stall_behaviour(mount_of(root, resolve=False))))
    mount = mount_of(root)
    tree_check = _check_tree(root)
    read_only = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    diagnoses = [tree_check, _check_mount(mount, read_only), responsive, stall_behaviour(mount), _check_space(root)]
    if tree_check.verdict is Verdict.OK:  # what the engines' eviction last recorded here
        status = eviction_status(KVTree.open(root))
        diagnoses.append(Diagnosis("eviction", Verdict.WARN if status.flagged else Verdict.OK, status.line()))
    with _ProbeDir(root) as probe:
        if read_only:
            diagnoses += [_skip(item, "read-only mount: the probe writes files") for item, _ in _WRITE_CHECKS]
            diagnoses += [_skip(item, "read-only mount: the probe writes files") for item in ("o_direct", "io_uring")]
        else:
            diagnoses += [_guarded(item, check, probe) for item, check in _WRITE_CHECKS]
            direct = _guarded("o_direct", lambda _: _check_direct(root), probe)
            diagnoses += [direct, _guarded("io_uring", lambda p: _check_uring(p, direct.verdict is Verdict.OK), probe)]
    diagnoses.append(_check_seed(environ))
    diagnoses.append(_skip("other_clients", "one process cannot see what another client sees: run pykv doctor "
                                            "on every node (docs/deployment.md)"))
    return DoctorReport(root, tuple(diagnoses))


# -- where probes may run ----------------------------------------------------------------------
def _check_tree(root: Path) -> Diagnosis:
    """The tree marker; raises when probes must not run here."""
    if not root.is_dir():
        raise NotATreeError(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    if not os.path.lexists(root / MARKER_NAME):
        refuse_inside_tree(root, "ROOT")  # a namespace, shard or .pykv of a tree is never probed as a root
        occupied = foreign_entries(root)
        if occupied:
            raise ProbeRefused(f"{root} is not a pykv tree and not empty ({len(occupied)} entries, e.g. "
                               f"{occupied[0]!r}): doctor probes only a tree or an empty directory; give a new "
                               "empty directory on the same mount")
        return Diagnosis("tree", Verdict.WARN, "not a pykv tree yet (an empty directory): an engine or "
                                               "`pykv init` makes it one")
    try:
        tree = KVTree.open(root)
        check_membership([tree], ["ROOT"])  # a marker copied over this tree from another device
        made_by = json.loads(read_small(root / MARKER_NAME)).get("created_by")
    except (NotATreeError, MembershipError, OSError, ValueError) as exc:
        return Diagnosis("tree", Verdict.FAIL, str(exc))
    made = f", created by {made_by}" if isinstance(made_by, str) else ""
    return Diagnosis("tree", Verdict.OK, f"pykv tree {tree.identity}, format version {FORMAT_VERSION}{made}")


def _check_mount(mount: Mount | None, read_only: bool) -> Diagnosis:
    if mount is None:
        return Diagnosis("mount", Verdict.SKIP, "/proc/self/mountinfo unreadable: file system unknown")
    where = f"{mount.fstype} {mount.source} at {mount.mount_point} ({','.join(mount.options)})"
    if read_only:
        return Diagnosis("mount", Verdict.WARN, f"{where}: read-only, only engines with store=false can use it")
    if mount.fstype.startswith("nfs") and mount.option("nocto") is not None:
        return Diagnosis("mount", Verdict.WARN, f"{where}: nocto, so a block published on another node may be "
                                                "read through stale attributes (a miss or a failed check)")
    return Diagnosis("mount", Verdict.OK, where + (", shared between nodes" if mount.network else ""))


def _check_space(root: Path) -> Diagnosis:
    st = os.statvfs(root)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    inodes = f", {st.f_favail:,} of {st.f_files:,} inodes free" if st.f_files else ", inodes not reported"
    line = f"{_gib(free)} of {_gib(total)} free{inodes}"
    if free < ALIGNMENT or (st.f_files and st.f_favail == 0):
        return Diagnosis("space", Verdict.FAIL, line + ": no room for a block")
    if (total and free < LOW_SPACE_FRACTION * total) or (st.f_files and st.f_favail < LOW_SPACE_FRACTION * st.f_files):
        return Diagnosis("space", Verdict.WARN, line + ": under 5% left (stores pause when it is full)")
    return Diagnosis("space", Verdict.OK, line)


def _gib(size: int) -> str:
    return f"{size / (1 << 30):,.1f} GiB"


# -- probes that write ------------------------------------------------------------------------
class _ProbeDir:
    """Probe files in ``root``, all named ``temp_name(PROBE_NAME)``, all removed on exit."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.fd = -1
        self._names: list[str] = []

    def __enter__(self) -> "_ProbeDir":
        self.fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._names:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self.fd)
        os.close(self.fd)

    def name(self) -> str:
        """A new probe name, removed on exit whether or not a file was made under it."""
        name = temp_name(PROBE_NAME)
        self._names.append(name)
        return name

    def write(self, content: bytes) -> str:
        name = self.name()
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        return name

    def read(self, name: str) -> bytes:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            return os.read(fd, 1 << 16)
        finally:
            os.close(fd)

    def stat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)


def _guarded(item: str, check: Callable[[_ProbeDir], Diagnosis], probe: _ProbeDir) -> Diagnosis:
    """A check; an ``OSError`` it did not expect fails the item with the error."""
    try:
        return check(probe)
    except OSError as exc:
        return Diagnosis(item, Verdict.FAIL, f"{exc.strerror or exc} during the probe")


def _skip(item: str, why: str) -> Diagnosis:
    return Diagnosis(item, Verdict.SKIP, why)


def _check_publish(probe: _ProbeDir) -> Diagnosis:
    """Publication as ``KVTree.publish`` does it: link, EEXIST for the loser, one link left."""
    first, second = probe.write(b"first writer"), probe.write(b"second writer")
    final = probe.name()
    try:
        os.link(first, final, src_dir_fd=probe.fd, dst_dir_fd=probe.fd, follow_symlinks=False)
    except OSError as exc:
        return Diagnosis("publish", Verdict.FAIL, f"hard link refused ({exc.strerror}): pykv publishes every "
                                                  "block by hard link and cannot store here")
    linked = probe.stat(final).st_nlink
    try:
        os.link(second, final, src_dir_fd=probe.fd, dst_dir_fd=probe.fd, follow_symlinks=False)
        return Diagnosis("publish", Verdict.FAIL, "a second link to a published name succeeded: two writers "
                                                  "of one block would not be told apart")
    except FileExistsError:
        pass
    except OSError as exc:
        return Diagnosis("publish", Verdict.FAIL, f"a second link failed with {exc.strerror}, not EEXIST: "
                                                  "the losing writer of a block would count an error")
    if probe.read(final) != b"first writer":
        return Diagnosis("publish", Verdict.FAIL, "the published name does not hold the first writer's bytes")
    os.unlink(first, dir_fd=probe.fd)
    left = probe.stat(final).st_nlink
    if left != 1:
        return Diagnosis("publish", Verdict.FAIL, f"a published file reports {left} links after its temp name "
                                                  "was removed: gc deletes only files with one link")
    note = "" if linked == 2 else f" (the link count read {linked} while both names existed)"
    return Diagnosis("publish", Verdict.OK, f"hard-link publication is atomic: a second link got EEXIST{note}")


def _check_rename(probe: _ProbeDir) -> Diagnosis:
    """A rename within the directory (quarantine and repairs move files by rename)."""
    source, target = probe.write(b"renamed"), probe.name()
    try:
        os.rename(source, target, src_dir_fd=probe.fd, dst_dir_fd=probe.fd)
    except OSError as exc:
        return Diagnosis("rename", Verdict.WARN, f"rename refused ({exc.strerror}): fsck --repair and the "
                                                 "quarantine of damaged blocks cannot move files")
    gone = not _exists(probe, source)
    if not gone or probe.read(target) != b"renamed":
        return Diagnosis("rename", Verdict.FAIL, "a rename left the old name or lost the content")
    return Diagnosis("rename", Verdict.OK, "rename within a directory works")


def _check_dir_fsync(probe: _ProbeDir) -> Diagnosis:
    try:
        os.fsync(probe.fd)
    except OSError as exc:
        return Diagnosis("dir_fsync", Verdict.WARN, f"fsync of a directory refused ({exc.strerror}): with "
                                                    "fsync=true a publication is not made durable")
    return Diagnosis("dir_fsync", Verdict.OK, "fsync of a directory works (fsync=true makes publications durable)")


def _check_atime(probe: _ProbeDir) -> Diagnosis:
    """``KVTree.touch`` stamps a hit's atime explicitly: that stamp must stick, the mtime stay."""
    name = probe.write(b"atime")
    before = probe.stat(name)
    stamp = (time.time_ns() // 1_000_000_000 - 3 * 86400) * 1_000_000_000  # 3 days back: relatime updates it
    os.utime(name, ns=(stamp, before.st_mtime_ns), dir_fd=probe.fd, follow_symlinks=False)
    stamped = probe.stat(name)
    if abs(stamped.st_atime_ns - stamp) > _TIME_SLACK_NS:
        return Diagnosis("atime", Verdict.WARN, "an explicit atime did not stick: gc cannot tell recently "
                                                "read blocks from old ones (it evicts in publication order)")
    if abs(stamped.st_mtime_ns - before.st_mtime_ns) > _TIME_SLACK_NS:
        return Diagnosis("atime", Verdict.WARN, "stamping the atime changed the mtime: gc's --min-age "
                                                "would count from the last hit")
    probe.read(name)  # a plain read: does the mount itself update atime?
    by_reads = "reads also update it" if probe.stat(name).st_atime_ns != stamped.st_atime_ns else \
        "reads alone leave it (noatime)"
    return Diagnosis("atime", Verdict.OK, f"an explicit atime sticks, as pykv stamps each hit; {by_reads}")


def _check_clock(probe: _ProbeDir) -> Diagnosis:
    """The file system's timestamps against this host's clock (gc's ``--min-age`` compares them)."""
    before = time.time()
    mtime = probe.stat(probe.write(b"clock")).st_mtime
    after = time.time()
    skew = mtime - after if mtime > after else (mtime - before if mtime < before else 0.0)
    if abs(skew) > CLOCK_SKEW_WARN_S:
        return Diagnosis("clock", Verdict.WARN, f"a new file's mtime is {skew:+.0f} s off this host's clock: "
                                                "gc's --min-age and recency are measured against it")
    return Diagnosis("clock", Verdict.OK, f"a new file's mtime agrees with this host's clock ({skew:+.1f} s)")


def _check_direct(root: Path) -> Diagnosis:
    ok, reason = direct_io_supported(root)
    if ok:
        return Diagnosis("o_direct", Verdict.OK, "O_DIRECT writes and reads an aligned block")
    return Diagnosis("o_direct", Verdict.WARN, f"{reason}; engines use buffered I/O here (the page cache)")


def _check_uring(probe: _ProbeDir, direct: bool) -> Diagnosis:
    """Create, write, reopen and read one aligned block through io_uring with the engine's flags."""
    ok, reason = uring_available()
    if not ok:
        return Diagnosis("io_uring", Verdict.WARN, f"{reason}; engines use the thread pool backend")
    mode = "with O_DIRECT" if direct else "buffered"
    flags_extra = os.O_DIRECT if direct else 0
    path = os.fsencode(os.path.join(probe.real_root, probe.name()))
    out, back = aligned_buffer(ALIGNMENT), aligned_buffer(ALIGNMENT)
    pattern = secrets.token_bytes(ALIGNMENT)
    out[:] = pattern
    with UringBackend(4) as ring:
        def run(request: IoRequest) -> int:
            ring.submit([request])
            done = ring.wait(1, timeout=URING_TIMEOUT_S)
            if not done:
                raise TimeoutError(f"io_uring {request.op.value} did not complete in {URING_TIMEOUT_S:.0f} s")
            if done[0].result < 0:
                raise OSError(-done[0].result, f"io_uring {request.op.value}: {os.strerror(-done[0].result)}")
            return done[0].result

        try:
            fd = run(IoRequest(OpKind.OPEN, "open", path=path, flags=WRITE_FLAGS | flags_extra, mode=0o600,
                               resolve=RESOLVE_NO_SYMLINKS))
            try:
                written = run(IoRequest(OpKind.WRITE, "write", fd=fd, address=buffer_address(out), length=ALIGNMENT))
            finally:
                run(IoRequest(OpKind.CLOSE, "close", fd=fd))
            fd = run(IoRequest(OpKind.OPEN, "open", path=path, flags=READ_FLAGS | flags_extra,
                               resolve=RESOLVE_NO_SYMLINKS))
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags_extra)  # as PosixMedium.check_opened: O_NONBLOCK off
                read = run(IoRequest(OpKind.READ, "read", fd=fd, address=buffer_address(back), length=ALIGNMENT))
            finally:
                run(IoRequest(OpKind.CLOSE, "close", fd=fd))
        except (OSError, TimeoutError) as exc:
            return Diagnosis("io_uring", Verdict.FAIL, f"{exc.strerror if isinstance(exc, OSError) else exc} "
                                                       f"({mode}): set io_engine=threadpool for this mount")
    if written != ALIGNMENT or read != ALIGNMENT or back[:] != pattern:
        return Diagnosis("io_uring", Verdict.FAIL, f"io_uring moved {written}/{read} bytes or wrong data ({mode}): "
                                                   "set io_engine=threadpool for this mount")
    if not direct:  # what io_engine=auto makes of it (pykv.media.build.io_engine_for)
        return Diagnosis("io_uring", Verdict.OK, "io_uring opens, writes and reads a block file buffered; "
                                                 "io_engine=auto reads this mount through the thread pool")
    return Diagnosis("io_uring", Verdict.OK, f"io_uring opens, writes and reads a block file {mode}")


def _exists(probe: _ProbeDir, name: str) -> bool:
    try:
        probe.stat(name)
        return True
    except FileNotFoundError:
        return False


_WRITE_CHECKS: tuple[tuple[str, Callable[[_ProbeDir], Diagnosis]], ...] = (
    ("publish", _check_publish), ("rename", _check_rename), ("dir_fsync", _check_dir_fsync),
    ("atime", _check_atime), ("clock", _check_clock))


# -- the environment -------------------------------------------------------------------------
def _check_seed(environ: Mapping[str, str]) -> Diagnosis:
    seed = environ.get(SEED_ENV)
    if seed is None:
        return Diagnosis("hash_seed", Verdict.WARN, f"{SEED_ENV} is unset in this environment: engines started "
                                                    "from it share blocks only with engines that also leave it "
                                                    "unset; every engine of a tree needs the same seed "
                                                    "(pykv serve sets 0)")
    return Diagnosis("hash_seed", Verdict.OK, f"{SEED_ENV}={seed} here: every engine sharing this tree must "
                                              "start with the same")

