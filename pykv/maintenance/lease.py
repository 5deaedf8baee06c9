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

A lease file that is not a regular file with one link (a planted link, FIFO or
directory; a second hard link that outlives a publish) is never touched: the lease is
refused (``LeaseRefused``) until ``pykv fsck`` has dealt with it. A regular file at the
lease's name that does not parse expires by its mtime.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from typing import Callable

from pykv.errors import UnsafePathError
from pykv.io.safe_paths import directory_fd, open_regular
from pykv.tree import HOST, LEASE_NAME, STATE_DIR, KVTree, replace_small, temp_name, write_small

LEASE_LIMIT = 4096  # a lease is ~150 bytes; anything larger is not one
RENEW_MARGIN_S = 1.0  # closer to its expiry, a lease is renewed the takeover's way (never renamed over)


class LeaseRefused(UnsafePathError):
    """What stands at the lease's name is not a file pykv wrote; it is left for ``pykv fsck``."""


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
        holder whose expiry passed). ``LeaseRefused`` if a foreign entry stands at its name."""
        with directory_fd(self.tree.root, STATE_DIR, create_mode=self.tree.options.dir_mode) as fd:
            if self._raw is not None and self._renew_at(fd):
                return True
            self._raw = None
            if self._publish(fd):
                return True
            current = _read(fd)
            if current is None:  # released between our link and our read: try once more
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
        expires_at = self._clock() + self.ttl_s
        data = {"holder": self.holder, "token": secrets.token_hex(8), "expires_at": expires_at,
                "host": HOST, "pid": os.getpid()}
        return json.dumps(data).encode(), expires_at

    def _publish(self, fd: int) -> bool:
        """Link a fresh lease to the lease's name: True if this holder won it."""
        raw, expires_at = self._content()
        temp = temp_name(LEASE_NAME)
        write_small(temp, raw, self.tree.options.file_mode, dir_fd=fd)
        try:
            os.link(temp, LEASE_NAME, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=fd)
        self._raw, self._expires_at = raw, expires_at
        return True

    def _renew_at(self, fd: int) -> bool:
        current = _read(fd)
        if current is None or current.raw != self._raw:
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
    """The tree's lease as it stands (None: no lease); ``LeaseRefused`` for a foreign entry there."""
    try:
        with directory_fd(tree.root, STATE_DIR) as fd:
            return _read(fd)
    except FileNotFoundError:
        return None


def _read(fd: int, name: str = LEASE_NAME) -> LeaseState | None:
    """The lease at ``name`` in the state dir ``fd``; None if there is none."""
    st = _settled_stat(fd, name)
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        raise LeaseRefused(errno.EEXIST, "not a lease pykv wrote (a link, FIFO, directory or hard-linked file); "
                           "left in place for 'pykv fsck'", f"{STATE_DIR}/{name}")
    try:
        with open_regular(name, limit=LEASE_LIMIT, dir_fd=fd) as opened:
            raw = opened.read(LEASE_LIMIT + 1, 0)
            mtime = opened.stat.st_mtime
    except FileNotFoundError:
        return None
    except UnsafePathError as exc:  # replaced by something else, or too large, since the stat
        raise LeaseRefused(exc.errno, exc.strerror, f"{STATE_DIR}/{name}") from None
    return _parse(raw, mtime)


PUBLISH_SETTLE_S = 2.5  # a publisher's temp link lives microseconds; network clients cache attributes ~1 s


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


def _parse(raw: bytes, mtime: float) -> LeaseState:
    """A lease's fields; content that is not a lease expires ``_UNPARSED_TTL_S`` after its mtime."""
    try:
        data = json.loads(raw)
        holder, expires_at = data["holder"], data["expires_at"]
        if isinstance(holder, str) and isinstance(expires_at, (int, float)) and not isinstance(expires_at, bool) \
                and expires_at == expires_at:
            return LeaseState(holder[:200], float(expires_at), raw)
    except (ValueError, TypeError, KeyError, RecursionError):
        pass
    return LeaseState("", mtime + _UNPARSED_TTL_S, raw)


_UNPARSED_TTL_S = 600.0  # a file at the lease's name that is no lease blocks eviction at most this long


def _remove_if(fd: int, expected: bytes) -> bool:
    """Remove the lease if it still holds ``expected``: rename it away (one remover wins), read
    what was renamed, delete it if it is ``expected``, else link it back. True if removed."""
    aside = temp_name(LEASE_NAME)
    try:
        os.rename(LEASE_NAME, aside, src_dir_fd=fd, dst_dir_fd=fd)
    except FileNotFoundError:
        return False
    try:
        taken = _read(fd, aside)
    except LeaseRefused:
        taken = None
    if taken is not None and taken.raw == expected:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside, dir_fd=fd)
        return True
    with contextlib.suppress(FileExistsError, FileNotFoundError):  # a fresh lease: put it back
        os.link(aside, LEASE_NAME, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(aside, dir_fd=fd)
    return False
