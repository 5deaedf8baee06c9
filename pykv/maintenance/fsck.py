"""Checking a tree for damage and repairing it.

Problems, by class (``Problem``), and what ``repair`` does with each:

==================  ================================================================  ==========
class               meaning                                                           repair
==================  ================================================================  ==========
``stale-temp``      a temp pykv left (a writer died), older than the grace period     delete \\*
``foreign``         anything the layout does not allow: files, links, FIFOs, dirs     move
``truncated``       shorter than its header says (or too short to hold a header)      move
``oversized``       longer than its header says                                       move
``bad-header``      bad magic, header checksum, version, fields or reserved bytes     move
``bad-checksum``    payload does not match the header's checksum                      move
``bad-mac``         (``--key-file``) signed with a key of the file, MAC does not match move
``misplaced``       a sound block under the wrong name or namespace for its header    move
``unreadable``      the block cannot be opened or read (permissions, I/O error)       move
==================  ================================================================  ==========

pykv never deletes a file it did not create. "move" is a rename into quarantine,
``<root>/.pykv/quarantine/<run>/<path relative to root>``, relative to the root's fd
(``KVTree.quarantine``): it moves the entry itself and never follows a symlink, so
nothing is lost and the user can take back what was theirs. \\* only a regular file
named as pykv's temps are named (``pykv.tree.temp_name``, in every place pykv
writes one: leaf dirs, namespace dirs, the root, ``.pykv``) with no other hard link
is deleted; a temp's name on anything else (a directory, a FIFO, a file linked from
elsewhere) is moved like foreign content. What stands at the eviction lease's name is
judged in full (``pykv.maintenance.lease.check_lease``: type, links, size, fields, expiry,
mtime), and so is the eviction record (``pykv.maintenance.evict_record.check_record``):
anything pykv did not write there is ``foreign``, and moved unless a sound one replaced it
meanwhile. The quarantine stays until someone deletes it: every
report counts what all of it holds after the run (``quarantined``, ``pykv.maintenance.quarantine``).

Young temps (within the grace period) may belong to a writer at work and are not
problems. A file that vanishes while being checked or repaired was deleted by gc
or another host and is simply gone. Empty shard dirs are left alone: removing one
could race a writer that just created it (``KVTree.ensure_parent``) and make its
write fail. Block reads use ``O_NOATIME`` (``pykv.io.safe_paths``): fsck does not
change what gc considers recently used.

With a key ring (``pykv fsck --key-file``) every sound block is also authenticated and
counted by class (``FsckReport.auth``: ``signed``, ``unsigned``, ``foreign-key``,
``bad-mac``); only ``bad-mac`` is a problem: an unsigned block or one signed with a key id
the file does not hold is not damage (an engine with the key refuses it as a miss).

A coded block (``pykv.format_codec``: a codec other than ``none`` stored its payload) is
checked like any other: its checksum (and MAC) over the stored bytes, its stored length within
its codec's bound (else ``bad-header``); sound ones are counted by codec (``FsckReport.codecs``).
Decoding is not tried: the engine that reads a block decodes it, and refuses it as a miss.

``fsck_devices`` checks a device set, what ``pykv fsck`` runs for one root or several: each
device is checked as a tree of its own (``fsck``, the one-tree step) and reported on its own.
Over two or more devices a sound block on a device other than the ones the set's placement
picks is *unreachable* for engines with that set (``pykv.maintenance.placement``): it is
counted per device, never a problem, and never moved or deleted. A set of one reaches every
block: its report is its tree's ``fsck`` report, with no device identity or unreachable count.
"""

from __future__ import annotations

import enum
import os
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pykv.auth import AuthStatus, KeyRing
from pykv.blockfile import CheckedBlock, check_block, read_header
from pykv.deviceset import DeviceSet
from pykv.errors import FormatError
from pykv.format import OversizedError, TruncatedError
from pykv.maintenance.evict_record import RECORD_PATH, check_record, quarantine_record
from pykv.maintenance.lease import LEASE_PATH, check_lease, quarantine_lease
from pykv.maintenance.placement import reachable as is_reachable
from pykv.maintenance.quarantine import QuarantineUsage, counted
from pykv.maintenance.scan import Entry, Kind, relative, walk
from pykv.io.safe_paths import unlink_beneath
from pykv.tree import QUARANTINE_DIR, KVTree

DEFAULT_GRACE_S = 3600.0


class Problem(str, enum.Enum):
    STALE_TEMP = "stale-temp"
    FOREIGN = "foreign"
    TRUNCATED = "truncated"
    OVERSIZED = "oversized"
    BAD_HEADER = "bad-header"
    BAD_CHECKSUM = "bad-checksum"
    BAD_MAC = "bad-mac"
    MISPLACED = "misplaced"
    UNREADABLE = "unreadable"

    @property
    def repair_action(self) -> str:
        """What repair does with it: "delete" (pykv's own temps only) or "quarantine" (a move)."""
        return "delete" if self is Problem.STALE_TEMP else "quarantine"


@dataclass(frozen=True)
class Finding:
    """One problem: the entry (path relative to the root), its class and why."""

    path: str
    problem: Problem
    detail: str
    is_dir: bool = False
    is_symlink: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "problem": self.problem.value, "detail": self.detail,
                "repair": self.problem.repair_action}


@dataclass
class FsckReport:
    """What a check found; after ``repair``, also what was fixed and what failed."""

    root: str
    blocks_checked: int = 0
    bytes_checked: int = 0
    findings: list[Finding] = field(default_factory=list)
    repaired: list[Finding] = field(default_factory=list)
    deleted: list[Finding] = field(default_factory=list)  # of ``repaired``: unlinked (pykv's temps)
    moved: list[Finding] = field(default_factory=list)  # of ``repaired``: renamed into quarantine
    failed: list[tuple[Finding, str]] = field(default_factory=list)
    quarantine: str | None = None
    device_id: str | None = None  # the tree's identity, when checked as a device of a set
    unreachable_blocks: int = 0  # sound blocks on a device the set does not look on (``placement``)
    unreachable_bytes: int = 0
    auth: Counter[str] | None = None  # with a key ring: sound blocks by ``AuthStatus`` value
    codecs: Counter[str] = field(default_factory=Counter)  # coded blocks in place, by codec params
    quarantined: QuarantineUsage = QuarantineUsage(0, 0)  # all of .pykv/quarantine, after the run

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(f.problem.value for f in self.findings))

    @property
    def remaining(self) -> list[Finding]:
        """Problems still in the tree (all findings until a repair ran)."""
        if self.quarantine is None:  # no repair ran
            return list(self.findings)
        return [finding for finding, _ in self.failed]

    @property
    def clean(self) -> bool:
        return not self.remaining

    def as_dict(self) -> dict[str, Any]:
        return {"root": self.root, "blocks_checked": self.blocks_checked, "bytes_checked": self.bytes_checked,
                "counts": self.counts, "findings": [f.as_dict() for f in self.findings],
                "repaired": len(self.repaired), "deleted": [f.path for f in self.deleted],
                "moved": [f.path for f in self.moved], "quarantine": self.quarantine,
                "failed": [{**f.as_dict(), "error": error} for f, error in self.failed],
                "clean": self.clean, "quarantined": self.quarantined.as_dict(),
                **({} if self.auth is None else {"auth": {status.value: self.auth[status.value]
                                                          for status in AuthStatus}}),
                **({"codecs": dict(self.codecs)} if self.codecs else {}),
                **({} if self.device_id is None else {
                    "id": self.device_id, "unreachable_blocks": self.unreachable_blocks,
                    "unreachable_bytes": self.unreachable_bytes})}


def check_block_file(tree: KVTree, path: str, keys: KeyRing | None = None) -> tuple[Problem, str] | None:
    """The problem with the block file at ``path``, or None if it is sound and in place (and, with
    ``keys``, not signed with a key of the ring under a wrong MAC).

    Raises ``FileNotFoundError`` if the file vanished.
    """
    return _inspect_block_file(tree, path, keys)[0]


def _inspect_block_file(tree: KVTree, path: str,
                        keys: KeyRing | None) -> tuple[tuple[Problem, str] | None, CheckedBlock | None]:
    """``check_block_file`` and the checked block (its header; with ``keys``, what the ring says of
    it), unless it is damaged or misplaced."""
    try:
        checked = check_block(Path(path), keys=keys)
    except FormatError as exc:
        return _classify_damage(path, exc), None
    except FileNotFoundError:
        raise
    except OSError as exc:
        return (Problem.UNREADABLE, str(exc)), None
    header = checked.header
    expected = tree.block_path(header.namespace.hex(), header.key)
    if str(expected) != path:
        return (Problem.MISPLACED, f"header says it belongs at {relative(tree, expected)}"), None
    if checked.auth is AuthStatus.BAD_MAC:
        return (Problem.BAD_MAC, f"{checked.auth.reason} (key {header.key_id.decode()})"), checked
    return None, checked


def _classify_damage(path: str, exc: FormatError) -> tuple[Problem, str]:
    """The class of ``check_block``'s error: by its type for the file's size; else the header, if it
    reads, was sound and the payload is damaged."""
    if isinstance(exc, TruncatedError):
        return Problem.TRUNCATED, exc.reason
    if isinstance(exc, OversizedError):
        return Problem.OVERSIZED, exc.reason
    try:
        read_header(Path(path))
    except FormatError:
        return Problem.BAD_HEADER, exc.reason
    return Problem.BAD_CHECKSUM, exc.reason


def _check_entry(tree: KVTree, entry: Entry, min_temp_mtime_ns: int,
                 keys: KeyRing | None = None) -> tuple[tuple[Problem, str] | None, CheckedBlock | None]:
    if entry.kind is Kind.BLOCK:
        return _inspect_block_file(tree, entry.path, keys)
    return _check_other(entry, min_temp_mtime_ns), None


def _check_other(entry: Entry, min_temp_mtime_ns: int) -> tuple[Problem, str] | None:
    if entry.kind is Kind.TEMP:
        if entry.mtime_ns < min_temp_mtime_ns:
            age = (time.time_ns() - entry.mtime_ns) / 1e9
            return Problem.STALE_TEMP, f"temp file {age:.0f}s old"
        return None
    if entry.kind is Kind.FOREIGN:
        what = "symlink" if entry.is_symlink else "directory" if entry.is_dir else "file"
        return Problem.FOREIGN, f"{what} not allowed here by the tree layout"
    return None


def fsck_devices(devices: DeviceSet, *, grace_s: float = DEFAULT_GRACE_S,
                 keys: KeyRing | None = None) -> list[FsckReport]:
    """``fsck`` of every device of a set, one report each in the set's order. Over two or more
    devices each report carries the device's identity and the count of its sound blocks the set
    cannot reach (never a problem: ``pykv.maintenance.placement``); a set of one is its tree's
    ``fsck`` report as it is."""
    if len(devices) == 1:
        return [fsck(devices[0], grace_s=grace_s, keys=keys)]
    reports = []
    for index, tree in enumerate(devices):
        report = fsck(tree, grace_s=grace_s, reachable=lambda path, i=index: is_reachable(devices, i, path),
                      keys=keys)
        report.device_id = tree.identity
        reports.append(report)
    return reports


def fsck(tree: KVTree, *, grace_s: float = DEFAULT_GRACE_S,
         reachable: Callable[[str], bool] | None = None, keys: KeyRing | None = None) -> FsckReport:
    """Walk the whole tree (no catalog) and check every entry; block files in full. ``reachable``:
    whether a sound block's path is where its set looks for it (counted in ``unreachable_*``).
    ``keys``: authenticate every block too and count the classes in ``auth``."""
    report = FsckReport(root=str(tree.root), auth=None if keys is None else Counter())
    min_temp_mtime_ns = time.time_ns() - int(grace_s * 1e9)
    for entry in walk(tree):
        try:
            found, checked = _check_entry(tree, entry, min_temp_mtime_ns, keys)
        except FileNotFoundError:
            continue
        if report.auth is not None and checked is not None and checked.auth is not None:
            report.auth[checked.auth.value] += 1
        if checked is not None and checked.header.coded:
            report.codecs[checked.header.codec] += 1
        if entry.kind is Kind.BLOCK:
            report.blocks_checked += 1
            report.bytes_checked += entry.size
        if found is None and entry.kind is Kind.BLOCK and reachable is not None and not reachable(entry.path):
            report.unreachable_blocks += 1
            report.unreachable_bytes += entry.size
        if found is not None:
            problem, detail = found
            report.findings.append(Finding(relative(tree, entry.path), problem, detail,
                                           entry.is_dir, entry.is_symlink))
    for state in (check_lease(tree), check_record(tree)):  # judged in full, not by type alone as the walk does
        if state is not None:
            report.findings = [f for f in report.findings if f.path != state.path] + [
                Finding(state.path, Problem.FOREIGN, state.detail, state.is_dir, state.is_symlink)]
    report.findings.sort(key=lambda f: f.path)
    report.quarantined = counted(tree)
    return report


def repair(tree: KVTree, report: FsckReport, keys: KeyRing | None = None) -> FsckReport:
    """Fix what ``report`` found: delete pykv's stale temps, move everything else to quarantine.

    Damaged blocks are checked again first (with ``keys``, the ring ``fsck`` used), so a block
    replaced by a sound one since the check is left alone. Updates and returns ``report`` (``deleted`` and
    ``moved`` say which entry went where).
    """
    run = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    report.quarantine = str(tree.state_dir / QUARANTINE_DIR / run)
    for finding in report.findings:
        path = str(tree.root / finding.path)
        try:
            if finding.problem is Problem.STALE_TEMP and _own_temp(tree, finding.path):
                unlink_beneath(tree.root, finding.path)
                report.deleted.append(finding)
            else:
                if finding.problem not in (Problem.STALE_TEMP, Problem.FOREIGN) \
                        and check_block_file(tree, path, keys) is None:
                    report.repaired.append(finding)
                    continue
                mover = _STATE_MOVERS.get(finding.path)
                if mover is None:
                    tree.quarantine(path, run)
                elif mover(tree, run) is None:  # a sound lease or record stands there by now: left
                    report.repaired.append(finding)
                    continue
                report.moved.append(finding)
        except FileNotFoundError:
            pass  # gone already: nothing left to fix
        except OSError as exc:
            report.failed.append((finding, exc.strerror or str(exc)))
            continue
        report.repaired.append(finding)
    report.quarantined = counted(tree)
    return report


#: State files pykv owns, moved by their own identity-checked mover (a sound one published meanwhile is kept).
_STATE_MOVERS = {LEASE_PATH: quarantine_lease, RECORD_PATH: quarantine_record}


def _own_temp(tree: KVTree, relative: str) -> bool:
    """A regular file with no other hard link: a temp pykv made (its name says so) and nobody
    else holds. Anything else under a temp's name is moved, not deleted."""
    st = os.lstat(tree.root / relative)
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1
