"""A lease file in a tree (``<root>/.pykv/evict.lease``): who may evict now, across engines and nodes.

No service and no POSIX lock (neither works across every network file system): the
lease is a small JSON file (holder, a random token, an expiry in wall-clock seconds)
published the way blocks are, by hard-linking a fully written temp to the final name.
``link`` is atomic with ``EEXIST`` on local file systems, NFS, JuiceFS, Lustre and
CephFS, so of several engines acquiring at once exactly one wins.

- **Renew**: the holder replaces the file (temp, then rename over) while its lease has
  time left; near or past its expiry it renews the way a takeover does (below), so a
  renew never overwrites a lease someone else took over.
- **Release and stale takeover**: a lease is removed by renaming it to a unique temp
  name (one rename wins), reading what was renamed and deleting it only if it holds the
  very bytes the remover judged (its own lease, or the expired one it read); anything
  else was a fresh lease taken in between, and is linked back. A lease whose holder
  crashed is taken over once its expiry has passed.

The residual race: while a remover holds a fresh lease under its temp name, a third
engine may acquire; the restore then meets ``EEXIST`` and two engines believe they
hold the lease until the first one's next renew finds the file changed (a holder that
stalls for a second between reading its lease and renaming over it, right at its expiry, is
the same case). Two evictors at once are harmless: each
deletes only old, published blocks in LRU order and counts a block the other already
deleted as freed by someone else, so at worst a little more is evicted; no reader ever
sees wrong data (a deleted block is a miss). Expiries compare the holder's clock with
the reader's: node clocks must agree within the time to live (NTP; ``pykv doctor``).

pykv owns the lease's name. Whatever stands there that pykv would not have written
(``LeaseDefect``: not a regular file, a second hard link, more than ``LEASE_LIMIT`` bytes,
not a lease's JSON fields and types, a non-finite expiry, an expiry beyond the longest
term pykv grants, ``MAX_TERM_S``, or before its own mtime by more than that, an mtime in
the future) is judged from ``lstat`` and at most ``LEASE_LIMIT + 1`` bytes, never
followed, never deleted: ``pykv fsck`` reports it (``check_lease``), and both
``fsck --repair`` and an evictor about to take the lease move it into the tree's
quarantine (``quarantine_lease``), so no file can stop eviction for longer than
``MAX_TERM_S`` + ``CLOCK_SKEW_S``.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import math
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pykv.errors import UnsafePathError
from pykv.io.safe_paths import directory_fd, open_regular, rename_beneath
from pykv.io.small_files import publish_small, replace_small
from pykv.tree import HOST, LEASE_NAME, QUARANTINE_DIR, STATE_DIR, KVTree, temp_name

log = logging.getLogger(__name__)

LEASE_LIMIT = 4096  # a lease is ~150 bytes; anything larger is not one
LEASE_PATH = f"{STATE_DIR}/{LEASE_NAME}"  # relative to the root
RENEW_MARGIN_S = 1.0  # closer to its expiry, a lease is renewed the takeover's way (never renamed over)
MAX_TERM_S = 600.0  # the longest term pykv grants a lease (a longer ``ttl_s`` is cut to it)
CLOCK_SKEW_S = 60.0  # node and file-server clocks may disagree this much (``pykv doctor`` warns at 30 s)


class StateFault(str, enum.Enum):
    """Why what stands at the name of a state file pykv owns (the lease; the eviction record,
    ``pykv.maintenance.evict_record``) is not one pykv wrote."""

    NOT_A_FILE = "not-a-file"  # a symlink, directory, FIFO, socket or device
    LINKED = "linked"  # a regular file with another hard link
    OVERSIZED = "oversized"
    UNPARSABLE = "unparsable"  # not JSON, or not the file's fields and types
    NON_FINITE = "non-finite"  # an expiry (a time) of Infinity or NaN
    FAR_EXPIRY = "far-expiry"  # beyond now + MAX_TERM_S, or long before it was written
    FUTURE_MTIME = "future-mtime"
    FUTURE_TIME = "future-time"  # a time in it after now + CLOCK_SKEW_S
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class StateDefect:
    """A foreign entry at a state file's name (``path``): why (``fault``, ``detail``), and which inode was judged."""

    fault: StateFault
    detail: str
    identity: tuple[int, int]  # (st_dev, st_ino)
    is_dir: bool = False
    is_symlink: bool = False
    path: str = LEASE_PATH


LeaseFault, LeaseDefect = StateFault, StateDefect  # at the lease's name


class LeaseRefused(UnsafePathError):
    """What stands at the lease's name is not a file pykv wrote (``read_lease``)."""


@dataclass(frozen=True)
class LeaseState:
    """What the lease file says: its holder, and when it expires (wall-clock seconds)."""

    holder: str
    expires_at: float
    raw: bytes


class Lease:
    """The lease of ``tree`` for ``holder``; ``acquire`` before acting, ``release`` after.

    Not thread-safe: one thread (the evictor's) uses it."""

    def __init__(self, tree: KVTree, holder: str | None = None, *, ttl_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        if not ttl_s > 0:
            raise ValueError("ttl_s must be positive")
        self.tree, self.ttl_s, self._clock = tree, ttl_s, clock
        self.holder = holder or new_holder_id()
        self._raw: bytes | None = None  # the content of our lease while we believe we hold it
        self._expires_at = 0.0

    @property
    def held(self) -> bool:
        """Whether this holder believes it holds the lease, unexpired by its own clock."""
        return self._raw is not None and self._clock() < self._expires_at

    def acquire(self) -> bool:
        """Take the lease: True if this holder holds it now (fresh, renewed, or taken over from a
        holder whose expiry passed, or from a ``LeaseDefect``, moved to quarantine first)."""
        with directory_fd(self.tree.root, STATE_DIR, create_mode=self.tree.options.dir_mode) as fd:
            if self._raw is not None and self._renew_at(fd):
                return True
            self._raw = None
            if self._publish(fd):
                return True
            current = _judge(fd, LEASE_NAME, self._clock())
            if current is None:  # released between our link and our read: try once more
                return self._publish(fd)
            if isinstance(current, LeaseDefect):
                with contextlib.suppress(FileNotFoundError):  # (another engine moved it first)
                    if quarantine_lease(self.tree, _run_name("evictor"), current) is not None:
                        log.warning("pykv: %s/%s: %s; moved to quarantine, the lease taken over",
                                    self.tree.root, LEASE_PATH, current.detail)
                return self._publish(fd)
            if self._clock() < current.expires_at:
                return False
            if not _remove_if(fd, current.raw):  # someone else took it over (or renewed) first
                return False
            return self._publish(fd)

    def renew(self) -> bool:
        """Extend the expiry of a lease this holder still holds; False (and not held) if it was lost."""
        if self._raw is None:
            return False
        with directory_fd(self.tree.root, STATE_DIR) as fd:
            return self._renew_at(fd)

    def release(self) -> None:
        """Remove the lease if it is still this holder's (never anyone else's)."""
        raw, self._raw = self._raw, None
        if raw is None:
            return
        with contextlib.suppress(OSError), directory_fd(self.tree.root, STATE_DIR) as fd:
            _remove_if(fd, raw)

    # -- the file ---------------------------------------------------------------------------------
    def _content(self) -> tuple[bytes, float]:
        expires_at = self._clock() + min(self.ttl_s, MAX_TERM_S)
        data = {"holder": self.holder, "token": secrets.token_hex(8), "expires_at": expires_at,
                "host": HOST, "pid": os.getpid()}
        return json.dumps(data).encode(), expires_at

    def _publish(self, fd: int) -> bool:
        """Link a fresh lease to the lease's name: True if this holder won it."""
        raw, expires_at = self._content()
        if not publish_small(LEASE_NAME, raw, self.tree.options.file_mode, dir_fd=fd):
            return False
        self._raw, self._expires_at = raw, expires_at
        return True

    def _renew_at(self, fd: int) -> bool:
        current = _judge(fd, LEASE_NAME, self._clock())
        if not isinstance(current, LeaseState) or current.raw != self._raw:
            self._raw = None  # lost: someone took it over (we had stalled past its expiry)
            return False
        if self._clock() > self._expires_at - min(self.ttl_s / 10, RENEW_MARGIN_S):
            removed = _remove_if(fd, self._raw)  # near or past its expiry: renew as a takeover would
            self._raw = None
            return removed and self._publish(fd)
        raw, expires_at = self._content()
        replace_small(LEASE_NAME, raw, self.tree.options.file_mode, dir_fd=fd)
        self._raw, self._expires_at = raw, expires_at
        return True


def new_holder_id() -> str:
    """A holder id unique across hosts and processes: ``<host>.<pid>.<random>``."""
    return f"{HOST}.{os.getpid()}.{secrets.token_hex(4)}"


def read_lease(tree: KVTree) -> LeaseState | None:
    """The tree's lease as it stands (None: no lease); ``LeaseRefused`` for a ``LeaseDefect`` there."""
    try:
        with directory_fd(tree.root, STATE_DIR) as fd:
            current = _judge(fd, LEASE_NAME, time.time())
    except FileNotFoundError:
        return None
    if isinstance(current, LeaseDefect):
        raise LeaseRefused(errno.EEXIST, f"not a lease pykv wrote: {current.detail}", LEASE_PATH)
    return current


def check_lease(tree: KVTree, now: float | None = None) -> LeaseDefect | None:
    """What is wrong with what stands at the tree's lease name (None: nothing, or a sound lease)."""
    try:
        with directory_fd(tree.root, STATE_DIR) as fd:
            current = _judge(fd, LEASE_NAME, time.time() if now is None else now)
    except OSError:  # no .pykv, or not a directory: the walk reports that
        return None
    return current if isinstance(current, LeaseDefect) else None


def quarantine_lease(tree: KVTree, run: str, judged: LeaseDefect | None = None) -> Path | None:
    """Move a ``LeaseDefect`` at the lease's name (``judged``, else judged now) to
    ``.pykv/quarantine/<run>/.pykv/evict.lease``; returns where, or None if a sound lease
    stands there (left alone). Never deletes or follows it; ``FileNotFoundError`` if nothing is there.

    The rename moves whatever stands there by then; if it is not the inode judged (a lease
    published meanwhile), it is linked back, as ``_remove_if`` does."""
    if judged is None:
        with directory_fd(tree.root, STATE_DIR) as fd:
            current = _judge(fd, LEASE_NAME, time.time())
        if current is None:
            raise FileNotFoundError(errno.ENOENT, "no lease", LEASE_PATH)
        if not isinstance(current, LeaseDefect):
            return None
        judged = current
    return quarantine_state_file(tree, LEASE_NAME, run, judged.identity)


def quarantine_state_file(tree: KVTree, name: str, run: str, identity: tuple[int, int]) -> Path | None:
    """Move what stands at ``.pykv/<name>`` to ``.pykv/quarantine/<run>/.pykv/<name>`` (renamed, never
    followed or deleted); returns where, or None when the rename took a regular file other than the
    inode judged (``identity``: one pykv published meanwhile), which is linked back."""
    parent = f"{STATE_DIR}/{QUARANTINE_DIR}/{run}/{STATE_DIR}"
    rename_beneath(tree.root, f"{STATE_DIR}/{name}", f"{parent}/{name}", dir_mode=tree.options.dir_mode)
    with directory_fd(tree.root, parent) as moved_fd:
        st = os.stat(name, dir_fd=moved_fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == identity or not stat.S_ISREG(st.st_mode):
            return tree.root / parent / name  # (a different non-file is not pykv's either)
        with directory_fd(tree.root, STATE_DIR) as fd, contextlib.suppress(FileExistsError):
            os.link(name, name, src_dir_fd=moved_fd, dst_dir_fd=fd, follow_symlinks=False)
        os.unlink(name, dir_fd=moved_fd)
    return None


def _run_name(who: str) -> str:
    """A quarantine run of its own (two movers never rename onto one name)."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{who}-{os.getpid()}-{secrets.token_hex(4)}"


def _judge(fd: int, name: str, now: float) -> LeaseState | LeaseDefect | None:
    """The lease at ``name`` in the state dir ``fd`` as of ``now``; None if there is none."""
    found = read_state_file(fd, name, now=now)
    return _parse(found[1], found[0], now) if isinstance(found, tuple) else found


def read_state_file(fd: int, name: str, *, limit: int = LEASE_LIMIT, noun: str = "lease", path: str = LEASE_PATH,
                    settle: bool = True, now: float | None = None
                    ) -> tuple[os.stat_result, bytes] | StateDefect | None:
    """The file at ``name`` in the state dir ``fd`` and its bytes, judged from its ``lstat`` before it
    is opened (no FIFO is opened, no link followed) and read no further than ``limit + 1`` bytes;
    None if there is none. ``settle``: a second link may be a publication in progress (the lease's);
    ``now``: an mtime after it (beyond ``CLOCK_SKEW_S``) is a defect."""
    st = _settled_stat(fd, name) if settle else _lstat(fd, name)
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = "symlink" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else \
            "FIFO" if stat.S_ISFIFO(st.st_mode) else "special file"
        return _defect(st, StateFault.NOT_A_FILE, f"a {kind}, not a {noun} pykv wrote", path)
    if st.st_nlink != 1:
        return _defect(st, StateFault.LINKED, f"a file with {st.st_nlink} hard links, not a {noun} pykv wrote", path)
    if st.st_size > limit:
        return _defect(st, StateFault.OVERSIZED, f"{st.st_size} bytes, more than a {noun}'s {limit}", path)
    try:
        with open_regular(name, limit=limit, dir_fd=fd) as opened:
            raw = opened.read(limit + 1, 0)
            st = opened.stat
    except FileNotFoundError:
        return None
    except UnsafePathError as exc:  # replaced since the stat by something else, or a larger file
        return _defect(st, StateFault.NOT_A_FILE, f"not a {noun} pykv wrote ({exc.strerror})", path)
    except OSError as exc:
        return _defect(st, StateFault.UNREADABLE, f"unreadable ({exc.strerror})", path)
    if len(raw) > limit:
        return _defect(st, StateFault.OVERSIZED, f"grew beyond a {noun}'s {limit} bytes", path)
    if now is not None and st.st_mtime > now + CLOCK_SKEW_S:
        return _defect(st, StateFault.FUTURE_MTIME, f"modified {st.st_mtime - now:.0f} s in the future", path)
    return st, raw


def _parse(raw: bytes, st: os.stat_result, now: float) -> LeaseState | LeaseDefect:
    """A lease's fields, or the defect of content pykv never writes."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return _defect(st, LeaseFault.UNPARSABLE, "not JSON, not a lease pykv wrote")
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("holder", "token", "host")) \
            or type(data.get("pid")) is not int or type(data.get("expires_at")) not in (int, float) \
            or not data["holder"]:
        return _defect(st, LeaseFault.UNPARSABLE, "not a lease's fields and types (holder, token, expires_at, "
                                                  "host, pid)")
    try:
        expires_at = float(data["expires_at"])
    except OverflowError:
        expires_at = math.inf
    if not math.isfinite(expires_at):
        return _defect(st, LeaseFault.NON_FINITE, f"expiry {data['expires_at']!r} is not a finite time")
    if expires_at > now + MAX_TERM_S + CLOCK_SKEW_S:
        return _defect(st, LeaseFault.FAR_EXPIRY, f"expires in {expires_at - now:.3g} s, beyond the longest term "
                                                  f"pykv grants ({MAX_TERM_S:.0f} s)")
    if expires_at < st.st_mtime - MAX_TERM_S - CLOCK_SKEW_S:
        return _defect(st, LeaseFault.FAR_EXPIRY, f"expired {st.st_mtime - expires_at:.3g} s before it was written")
    return LeaseState(data["holder"][:200], expires_at, raw)


def _defect(st: os.stat_result, fault: StateFault, detail: str, path: str = LEASE_PATH) -> StateDefect:
    return StateDefect(fault, detail, (st.st_dev, st.st_ino), stat.S_ISDIR(st.st_mode), stat.S_ISLNK(st.st_mode), path)


PUBLISH_SETTLE_S = 2.5  # a publisher's temp link lives microseconds; network clients cache attributes ~1 s


def _lstat(fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _settled_stat(fd: int, name: str) -> os.stat_result | None:
    """``name``'s lstat once a publisher's second link is gone: a regular file with two links is
    a lease being published (linked, its temp not yet unlinked) or a client's cached attributes,
    so it is stat'ed again for up to ``PUBLISH_SETTLE_S`` before it counts as a foreign file."""
    deadline = time.monotonic() + PUBLISH_SETTLE_S
    pause = 0.005
    while True:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 2) or time.monotonic() >= deadline:
            return st
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


def _remove_if(fd: int, expected: bytes) -> bool:
    """Remove the lease if it still holds ``expected``: rename it away (one remover wins), read
    what was renamed, delete it if it is ``expected``, else link it back. True if removed."""
    aside = temp_name(LEASE_NAME)
    try:
        os.rename(LEASE_NAME, aside, src_dir_fd=fd, dst_dir_fd=fd)
    except FileNotFoundError:
        return False
    taken = read_state_file(fd, aside)
    if isinstance(taken, tuple) and taken[1] == expected:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside, dir_fd=fd)
        return True
    with contextlib.suppress(FileExistsError, FileNotFoundError):  # a fresh lease: put it back
        os.link(aside, LEASE_NAME, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside, dir_fd=fd)
    return False
