"""Acting only inside a root: validated names, no symlink followed, every read bounded.

Everything pykv writes, renames, deletes or reads in a tree goes through here:

* a name is one path component: not empty, not ``.`` or ``..``, no ``/`` or NUL, at most
  255 bytes (``check_name``) — names read back from the catalog included;
* a path below the root is opened relative to an fd of the root with openat2
  ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (a per-component ``O_NOFOLLOW`` walk where
  openat2 is missing): a symlink anywhere below the root (``.pykv``, its quarantine, a
  namespace or shard dir) fails with ``ELOOP`` instead of sending the act elsewhere;
* a file is read only after ``open(O_NONBLOCK | O_NOFOLLOW | O_NOATIME)`` and an
  ``fstat`` of that fd showed a regular file of a plausible size (a FIFO cannot block the
  open, ``/dev/zero`` or a 1 TiB file cannot be read into memory), in pieces of at most
  ``READ_PIECE`` bytes, and without changing its atime (gc's recency): ``O_NOATIME``
  where the kernel permits it, else the atime is put back after the read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Iterator

from pykv.errors import UnsafePathError
from pykv.io.openat2 import RESOLVE_BENEATH, RESOLVE_NO_SYMLINKS, enter_directory, openat2

MAX_NAME_BYTES = 255
METADATA_LIMIT = 1 << 20  # the marker, namespace.json, gc.json: a few hundred bytes each
READ_PIECE = 64 << 20  # no single pread asks for more (and none for more than 2 GiB, Linux's cap)
STREAM_PIECE = 8 << 20  # the buffer ``OpenedFile.pieces`` reuses (a fresh 64 MiB per read ran at 0.3 GB/s)
_BENEATH = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_NOATIME = getattr(os, "O_NOATIME", 0)


def check_name(name: str) -> str:
    """``name`` if it is a single safe path component, else ``UnsafePathError``."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise UnsafePathError(errno.EINVAL, "not a single path component", repr(name))
    if len(os.fsencode(name)) > MAX_NAME_BYTES:
        raise UnsafePathError(errno.ENAMETOOLONG, f"name longer than {MAX_NAME_BYTES} bytes", repr(name[:40]))
    return name


def components(relative: str | Path) -> list[str]:
    """The checked components of a path relative to a root (absolute paths refused)."""
    text = os.fspath(relative)
    if text.startswith("/"):
        raise UnsafePathError(errno.EXDEV, "absolute path where one below the root belongs", text)
    return [check_name(part) for part in text.split("/") if part]


@contextlib.contextmanager
def directory_fd(root: str | Path, relative: str | Path = "", *, create_mode: int | None = None) -> Iterator[int]:
    """An ``O_PATH`` fd of the directory ``relative`` below ``root`` (closed on exit).

    With ``create_mode``, missing directories are made (that mode), one component at a
    time, each entered without following a link.
    """
    parts = components(relative)
    fd = os.open(root, _DIR_FLAGS)
    try:
        if create_mode is None:
            if parts:
                below = openat2("/".join(parts), _DIR_FLAGS, 0, _BENEATH, dir_fd=fd)
                os.close(fd)
                fd = below
        else:
            for name in parts:
                try:
                    os.mkdir(name, create_mode, dir_fd=fd)
                except FileExistsError:
                    pass
                fd, above = -1, fd
                fd = enter_directory(above, name)  # closes ``above``, also when it raises
        yield fd
    finally:
        if fd >= 0:
            os.close(fd)


def open_beneath(root: str | Path, relative: str | Path, flags: int, mode: int = 0) -> int:
    """Open ``relative`` below ``root`` with no symlink followed and no escape above ``root``."""
    parts = components(relative)
    if not parts:
        raise UnsafePathError(errno.EINVAL, "empty path", os.fspath(relative))
    with directory_fd(root) as fd:
        return openat2("/".join(parts), flags | os.O_NOFOLLOW, mode, _BENEATH, dir_fd=fd)


def _split(relative: str | Path) -> tuple[str, str]:
    parts = components(relative)
    if not parts:
        raise UnsafePathError(errno.EINVAL, "empty path", os.fspath(relative))
    return "/".join(parts[:-1]), parts[-1]


def unlink_beneath(root: str | Path, relative: str | Path) -> None:
    """Unlink the entry ``relative`` below ``root`` (a symlink itself, never its target)."""
    parent, name = _split(relative)
    with directory_fd(root, parent) as fd:
        os.unlink(name, dir_fd=fd)


def publish_beneath(root: str | Path, temp: str | Path, final: str | Path) -> bool:
    """Hard-link ``temp`` to ``final`` (one directory below ``root``) and unlink ``temp``, both
    relative to that directory's fd: nothing is followed, so a directory swapped for a link after
    the temp was written fails here (``ELOOP``) instead of linking or unlinking elsewhere. False
    when ``final`` exists (another writer won); ``temp`` is gone either way."""
    parent, temp_name = _split(temp)
    final_parent, final_name = _split(final)
    if parent != final_parent:
        raise UnsafePathError(errno.EXDEV, "a temp and its final name in different directories", os.fspath(final))
    with directory_fd(root, parent) as fd:
        try:
            os.link(temp_name, final_name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name, dir_fd=fd)


def rename_beneath(root: str | Path, source: str | Path, destination: str | Path, *, dir_mode: int) -> None:
    """Rename ``source`` to ``destination``, both below ``root``; missing directories above
    ``destination`` are made with ``dir_mode``. Nothing on either side is followed."""
    source_parent, source_name = _split(source)
    destination_parent, destination_name = _split(destination)
    with directory_fd(root, source_parent) as source_fd, \
            directory_fd(root, destination_parent, create_mode=dir_mode) as destination_fd:
        os.rename(source_name, destination_name, src_dir_fd=source_fd, dst_dir_fd=destination_fd)


def relative_to(root: str | Path, path: str | Path) -> str:
    """``path`` (absolute, inside ``root``) relative to ``root``; ``UnsafePathError`` otherwise."""
    root_text, text = os.fspath(root).rstrip("/"), os.fspath(path)
    if not text.startswith(root_text + "/"):
        raise UnsafePathError(errno.EXDEV, "outside the tree's root", text)
    return text[len(root_text) + 1:]


# -- bounded reads ------------------------------------------------------------------------------
class OpenedFile:
    """A regular file opened for reading by ``open_regular``; restores its atime on ``close``."""

    def __init__(self, fd: int, st: os.stat_result, restore_atime: bool) -> None:
        self.fd, self.stat, self._restore_atime = fd, st, restore_atime

    @property
    def size(self) -> int:
        return self.stat.st_size

    def read(self, length: int, offset: int) -> bytes:
        """Up to ``length`` bytes at ``offset`` (short at end of file), in bounded preads."""
        out = bytearray(length)
        view, done = memoryview(out), 0
        while done < length:
            got = os.preadv(self.fd, [view[done:done + READ_PIECE]], offset + done)
            if got == 0:
                break
            done += got
        del view
        del out[done:]
        return bytes(out)

    def pieces(self, length: int, offset: int) -> Iterator[memoryview]:
        """``length`` bytes from ``offset`` (stops at end of file) as views of one reused buffer of
        at most ``STREAM_PIECE`` bytes, each valid until the next is asked for. A hole (``SEEK_DATA``)
        comes as zeros without a read: a sparse file claiming gigabytes costs no page faults."""
        buffer = memoryview(bytearray(min(STREAM_PIECE, max(length, 0))))
        zeros: memoryview | None = None
        position, end = offset, offset + length
        while position < end:
            data = self._next_data(position)
            if data is None:
                return  # at or past the end of the file
            if data > position:  # a hole: zeros, as a read would give them
                zeros = zeros if zeros is not None else memoryview(bytes(len(buffer)))
                count = min(len(zeros), min(data, end) - position)
                position += count
                yield zeros[:count]
                continue
            got = os.preadv(self.fd, [buffer[:min(len(buffer), end - position)]], position)
            if got == 0:
                return
            position += got
            yield buffer[:got]

    def _next_data(self, position: int) -> int | None:
        """The offset of the first data byte at or after ``position`` (``position`` itself where the
        file system cannot tell holes), its size where only a hole follows, None at the end."""
        try:
            return os.lseek(self.fd, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                return position  # no hole support (EINVAL): read everything
        size = os.fstat(self.fd).st_size
        return size if position < size else None

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            if self._restore_atime:  # O_NOATIME was refused: put the atime back (gc's recency)
                with contextlib.suppress(OSError):
                    os.utime(self.fd, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        finally:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "OpenedFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_regular(path: str | Path, *, limit: int | None = None, dir_fd: int | None = None) -> OpenedFile:
    """Open ``path`` for reading without blocking, following a link or changing its atime;
    ``UnsafePathError`` unless it is a regular file of at most ``limit`` bytes."""
    restore = False
    try:
        fd = os.open(path, _READ_FLAGS | _NOATIME, dir_fd=dir_fd)
    except PermissionError:  # O_NOATIME needs ownership (or CAP_FOWNER)
        if not _NOATIME:
            raise
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
        restore = True
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})", os.fspath(path))
        if limit is not None and st.st_size > limit:
            raise UnsafePathError(errno.EFBIG, f"{st.st_size} bytes, more than the {limit} allowed here",
                                  os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return OpenedFile(fd, st, restore)


def read_small(path: str | Path, *, limit: int = METADATA_LIMIT) -> bytes:
    """All of a small metadata file (marker, namespace.json, gc.json), bounded by ``limit``."""
    with open_regular(path, limit=limit) as opened:
        data = opened.read(limit + 1, 0)
    if len(data) > limit:
        raise UnsafePathError(errno.EFBIG, f"grew beyond the {limit} bytes allowed here", os.fspath(path))
    return data


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"
