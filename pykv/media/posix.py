"""The POSIX file medium: block files in one ``KVTree`` on a local filesystem.

Reads open the block under the tree's real root with openat2 ``RESOLVE_NO_SYMLINKS``
(a symlink planted anywhere below the root fails with ``ELOOP``), ``O_NOFOLLOW`` and
``O_NONBLOCK`` (a FIFO planted at a block's name cannot block the open; the one fstat
after it refuses anything but a regular file), and ``O_DIRECT`` unless the medium is
opened without it. Stores create the shard directories without following links, write
a temporary name beside the block with ``O_CREAT | O_EXCL`` and publish it by ``link``
(never replacing a published block). Quarantine renames relative to the root.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from pykv.io.openat2 import RESOLVE_NO_SYMLINKS
from pykv.io.safe_paths import relative_to, unlink_beneath
from pykv.media.base import Medium, OpenSpec, WriteTarget
from pykv.tree import KVTree

READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class PosixMedium(Medium):
    """Block files in ``tree``; ``direct``: open them with ``O_DIRECT`` (bypass the page cache)."""

    name = "posix"

    def __init__(self, tree: KVTree, *, direct: bool = True) -> None:
        self.tree = tree
        self._direct = os.O_DIRECT if direct else 0
        self._root_prefix = os.path.join(os.fspath(tree.root), "")
        self._real_root_prefix = tree.real_root_prefix  # resolved once, now

    @property
    def opens_direct(self) -> bool:
        return bool(self._direct)

    @property
    def sync_before_publish(self) -> bool:
        return self.tree.options.fsync

    def locate(self, namespace_id: str, key: bytes) -> Path:
        return self.tree.block_path(namespace_id, key)

    def contains(self, namespace_id: str, key: bytes) -> bool:
        return self.tree.contains(namespace_id, key)

    def touch(self, location: Path) -> bool:
        return self.tree.touch(location)

    def open_for_read(self, location: Path) -> OpenSpec:
        path, resolve = self._beneath_root(location)
        return OpenSpec(path, READ_FLAGS | self._direct, resolve=resolve)

    def check_opened(self, fd: int) -> int:
        """One fstat right after the open. It also clears the open's ``O_NONBLOCK``: io_uring would
        hand it to the reads (EAGAIN where a filesystem cannot read without blocking)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
            raise OSError(code, os.strerror(code))
        fcntl.fcntl(fd, fcntl.F_SETFL, self._direct)
        return st.st_size

    def prepare_write(self, location: Path) -> WriteTarget:
        self.tree.ensure_parent(location)
        temp = self.tree.temp_path(location)
        path, resolve = self._beneath_root(temp)
        return WriteTarget(temp, OpenSpec(path, WRITE_FLAGS | self._direct, self.tree.options.file_mode, resolve))

    def publish(self, temp: Path, location: Path) -> bool:
        return self.tree.publish(temp, location)

    def abandon(self, temp: Path) -> None:
        try:
            unlink_beneath(self.tree.root, relative_to(self.tree.root, temp))
        except OSError:  # gone already, or a link planted in its way: nothing outside is removed
            pass

    def quarantine(self, location: Path, run: str) -> Path:
        return self.tree.quarantine(location, run)

    def _beneath_root(self, path: Path) -> tuple[bytes, int]:
        """A file in the tree is opened under the tree's real root with ``RESOLVE_NO_SYMLINKS``;
        another path (a tool's own file) with ``O_NOFOLLOW`` on its last name only."""
        text = os.fspath(path)
        if text.startswith(self._root_prefix):
            return os.fsencode(self._real_root_prefix + text[len(self._root_prefix):]), RESOLVE_NO_SYMLINKS
        return os.fsencode(text), 0
