"""The hash-addressed file tree: paths, the tree marker, atomic publication, access stamps.

Layout::

    <root>/pykv-tree.json                   marks a pykv tree
    <root>/.pykv/                           catalog, quarantine, gc state, eviction lease (never on the hot path)
    <root>/<namespace>/namespace.json       the namespace, for people
    <root>/<namespace>/<aa>/<bb>/<key>.kv   one storage block (``aa``/``bb``: first hex digits of key)

Only hex strings are ever joined into paths. A block is published by hard-linking
a fully written temp file (same directory) to its final name: the first writer
wins, later writers get EEXIST and drop their copy, so readers never see a
partial file under a final name. A lookup is an existence check of the final name.

Access recency for gc is stamped explicitly: ``touch`` sets the file's atime to
now (keeping mtime, the publication time), which works whatever ``relatime`` or
``noatime`` the mount uses.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import xxhash

from pykv.errors import NotATreeError
from pykv.format import FORMAT_VERSION
from pykv.io.openat2 import RESOLVE_NO_SYMLINKS, enter_directory, openat2
from pykv.io.safe_paths import (check_name, components, directory_fd, publish_beneath, read_small, relative_to,
                                 rename_beneath, unlink_beneath)
from pykv.io.small_files import publish_small, write_small
from pykv.namespace import Namespace
from pykv.roots import refuse_if_occupied, refuse_inside_tree, require_root
from pykv.treenames import (  # noqa: F401  (re-exported: callers find a tree's names here)
    BLOCK_SUFFIX, EVICT_RECORD_NAME, GC_STATE_NAME, HOST, LEASE_NAME, MARKER_NAME, NAMESPACE_FILE, PROBE_NAME,
    QUARANTINE_DIR, ROOT_EXEMPT, ROOT_KEY, ROOT_RULE, SET_NAME, STATE_DIR, TEMP_INFIX, is_hex, is_temp_name,
    is_temp_of, temp_name)

STAMP_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
"""How ``KVTree.stamp`` opens a block: never blocking on a planted FIFO, never through a link."""


@dataclass(frozen=True)
class TreeOptions:
    """How files are created: modes (private to the user by default) and durability."""

    file_mode: int = 0o600
    dir_mode: int = 0o700
    fsync: bool = False


class KVTree:
    """A pykv tree rooted at ``root``. Use ``open`` (must exist) or ``create``."""

    def __init__(self, root: Path | str, options: TreeOptions | None = None) -> None:
        self.root = Path(root).absolute()  # "." and "./" alike: the paths of a walk and of a block agree
        self._prefixes: dict[str, str] = {}  # namespace id -> "<root>/<id>/" (``contains``)
        self.options = options or TreeOptions()
        self._identity: str | None = None

    @property
    def identity(self) -> str:
        """The tree's own name (16 hex digits), kept by its marker wherever the tree is mounted:
        the marker's ``tree_id``, or for a marker without one the xxh3-64 of its bytes. Placement
        over several devices goes by it (``pykv.deviceset``), so moving a mount keeps its blocks."""
        if self._identity is None:
            self._identity = _marker_identity(self.root)[1]
        return self._identity

    # -- marker ---------------------------------------------------------------------------
    @classmethod
    def open(cls, root: Path | str, options: TreeOptions | None = None) -> "KVTree":
        """Open an existing tree; raise ``NotATreeError`` naming what is wrong."""
        root = Path(root)
        if not root.is_dir():
            raise NotATreeError(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
        data, identity = _marker_identity(root)
        version = data.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:  # not True, 1.0 or "1"
            raise NotATreeError(f"{root / MARKER_NAME}: field format_version is {version!r}, "
                                f"this pykv needs {FORMAT_VERSION}")
        tree = cls(root, options)
        tree._identity = identity
        return tree

    @classmethod
    def create(cls, root: Path | str, options: TreeOptions | None = None, *, adopt: bool = False,
               field: str = ROOT_KEY, mkdir: bool = True) -> "KVTree":
        """Open ``root`` as a tree, writing its marker if absent.

        ``mkdir`` (library use and tests) creates a missing directory and its parents; the
        engines (``DeviceSet.create``) and ``pykv init`` pass False: the root must exist
        (``require_root``) and lie inside no other tree (``refuse_inside_tree``). A directory
        that holds anything but what pykv makes is refused (``NotEmptyRootError``, naming
        ``field``) unless ``adopt`` (``pykv init``): an engine pointed at the user's files never
        claims them as a tree. A new marker drops a device set record left beside it.
        """
        tree = cls(root, options)
        if mkdir:
            tree.root.mkdir(parents=True, exist_ok=True, mode=tree.options.dir_mode)
        else:
            require_root(tree.root, field)
        marker = tree.root / MARKER_NAME
        if not os.path.lexists(marker):
            if not mkdir:
                refuse_inside_tree(tree.root, field)
            if not adopt:
                refuse_if_occupied(tree.root, field)
            from pykv import __version__
            content = json.dumps({"format_version": FORMAT_VERSION, "created_by": f"pykv {__version__}",
                                  "created_on": HOST, "created_at": time.time(),
                                  "tree_id": secrets.token_hex(8)}, indent=2).encode()
            temp = tree.root / temp_name(MARKER_NAME)
            write_small(temp, content, tree.options.file_mode)
            if tree.publish(temp, marker):
                with contextlib.suppress(OSError):  # none; a planted .pykv link is fsck's to report
                    unlink_beneath(tree.root, f"{STATE_DIR}/{SET_NAME}")
        return cls.open(root, options)

    @property
    def state_dir(self) -> Path:
        """``<root>/.pykv``: catalog, quarantine and gc state."""
        return self.root / STATE_DIR

    def ensure_state_dir(self) -> Path:
        """``state_dir``, created if missing; ``OSError`` (ELOOP) if a link or file stands there."""
        try:
            os.mkdir(self.state_dir, self.options.dir_mode)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(self.state_dir).st_mode):
                raise OSError(errno.ELOOP, "not a directory (a planted link?)", str(self.state_dir)) from None
        return self.state_dir

    # -- layout ---------------------------------------------------------------------------
    def namespace_dir(self, namespace_id: str) -> Path:
        _require_hex(namespace_id, "namespace id")
        return self.root / namespace_id

    def block_path(self, namespace_id: str, key: bytes) -> Path:
        """The path of a (namespace, key): ``_block_name`` spells it."""
        return Path(self._block_name(namespace_id, key))

    def _block_name(self, namespace_id: str, key: bytes) -> str:
        """A (namespace, key)'s path as a string (below the namespace: ``_name_in_namespace``, which
        ``stamp`` shares): the scheduler's ``contains`` runs for every block of every request, and
        pathlib costs more than its ``lstat``."""
        return self._namespace_prefix(namespace_id) + _name_in_namespace(key)

    def temp_path(self, final: Path) -> Path:
        """A unique temp name beside ``final`` (host, pid, random)."""
        return final.with_name(temp_name(final.name))

    def ensure_namespace(self, namespace: Namespace) -> Path:
        """Create the namespace directory and its ``namespace.json`` if missing (relative to the
        root's fd, no link followed; the temp is removed also when the write fails)."""
        directory = self.namespace_dir(namespace.id)
        with directory_fd(self.root, namespace.id, create_mode=self.options.dir_mode) as fd:
            if _exists_at(fd, NAMESPACE_FILE):
                return directory
            data = {"id": namespace.id, **namespace.describe()}
            publish_small(NAMESPACE_FILE, json.dumps(data, indent=2).encode(), self.options.file_mode, dir_fd=fd)
        return directory

    def ensure_parent(self, path: Path) -> None:
        """Create the namespace and shard directories above a block path (mode from options).

        Each directory is created and entered without following symlinks (a planted
        symlink fails with ``ELOOP`` instead of sending the write elsewhere). A missing
        namespace directory is created only while the root still holds the tree marker:
        a tree deleted under a running engine, or a mount point whose filesystem went
        away, is never silently filled again (``FileNotFoundError``).
        """
        parent = path.parent
        if parent.is_dir():
            return  # the common case; the serving path's open itself refuses symlinks (RESOLVE_NO_SYMLINKS)
        names = (parent.parent.parent.name, parent.parent.name, parent.name)  # namespace, aa, bb
        fd = os.open(parent.parent.parent.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # the root
        try:
            for depth, name in enumerate(names):
                if depth == 0 and not _exists_at(fd, name) and not _exists_at(fd, MARKER_NAME):
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.root / MARKER_NAME))
                try:
                    os.mkdir(name, mode=self.options.dir_mode, dir_fd=fd)
                except FileExistsError:
                    pass
                fd, above = -1, fd
                fd = enter_directory(above, name)  # closes ``above``, also when it raises
        finally:
            if fd >= 0:
                os.close(fd)

    # -- lookup, publication, access --------------------------------------------------------
    def contains(self, namespace_id: str, key: bytes) -> bool:
        """Existence check of the final name (a symlink is not a block)."""
        try:
            return os.lstat(self._block_name(namespace_id, key)).st_mode & 0o170000 == 0o100000
        except OSError:
            return False

    def _namespace_prefix(self, namespace_id: str) -> str:
        prefix = self._prefixes.get(namespace_id)
        if prefix is None:
            prefix = self._prefixes[namespace_id] = f"{self.namespace_dir(namespace_id)}/"
        return prefix

    def publish(self, temp: Path, final: Path) -> bool:
        """Link ``temp`` to ``final`` (beside it in the tree) and unlink ``temp``, relative to
        their directory's fd with no link followed (``publish_beneath``). False when another
        writer won."""
        won = publish_beneath(self.root, relative_to(self.root, temp), relative_to(self.root, final))
        if won and self.options.fsync:
            _fsync_directory(final.parent)
        return won

    @functools.cached_property
    def real_root_prefix(self) -> str:
        """The root with the links above it resolved, and a trailing ``/``: those links are the
        admin's; below it the serving path follows none (``RESOLVE_NO_SYMLINKS``)."""
        return os.path.join(os.path.realpath(self.root), "")

    def touch(self, path: Path | str) -> bool:
        """``stamp`` a file of the tree by its path (below the root; ``UnsafePathError`` for one
        outside it or through ``..``)."""
        return self._stamp_below_root("/".join(components(relative_to(self.root, path))))

    def stamp(self, namespace_id: str, key: bytes) -> bool:
        """Stamp the block of a (namespace, key) as used now (atime; mtime kept), as a disk hit
        does: ``_stamp_below_root``."""
        _require_hex(namespace_id, "namespace id")
        return self._stamp_below_root(f"{namespace_id}/{_name_in_namespace(key)}")

    def _stamp_below_root(self, relative: str) -> bool:
        """Open ``relative`` under the real root without following any link (a link planted as a
        namespace or shard directory, or at the name, is never stamped through) and without
        blocking (a FIFO), and stamp it through its fd if it is a regular file. False when it is
        not there, a link is in its way, or it is no regular file."""
        try:
            fd = openat2(self.real_root_prefix + relative, STAMP_FLAGS, resolve=RESOLVE_NO_SYMLINKS)
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                return False
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return False
            os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
            return True
        finally:
            os.close(fd)

    def quarantine(self, path: Path | str, run: str) -> Path:
        """Move ``path`` (inside the tree) to ``.pykv/quarantine/<run>/<its relative path>``.

        A rename relative to the root's fd (``pykv.io.safe_paths``): no symlink on either
        side is followed (a planted ``.pykv`` or ``quarantine`` link fails with ``ELOOP``),
        missing directories get ``dir_mode``. Raises ``OSError`` (``FileNotFoundError``
        when someone removed it first).
        """
        relative = relative_to(self.root, path)
        destination = f"{STATE_DIR}/{QUARANTINE_DIR}/{check_name(run)}/{relative}"
        rename_beneath(self.root, relative, destination, dir_mode=self.options.dir_mode)
        return self.root / destination

    def namespaces(self) -> Iterator[Path]:
        """Namespace directories (hex names only)."""
        with os.scandir(self.root) as entries:
            for entry in entries:
                if is_hex(entry.name) and entry.is_dir(follow_symlinks=False):
                    yield Path(entry.path)


def _name_in_namespace(key: bytes) -> str:
    """A block's path below its namespace directory: two shard levels, then the key's hex name."""
    name = key.hex()
    return f"{name[:2]}/{name[2:4].ljust(2, '0')}/{name}{BLOCK_SUFFIX}"


def _marker_identity(root: Path) -> tuple[dict, str]:
    """The marker's fields and the tree's identity; ``NotATreeError`` naming what is wrong."""
    marker = root / MARKER_NAME
    try:
        raw = read_small(marker)
        data = json.loads(raw)
    except FileNotFoundError:
        raise NotATreeError(f"{root}: not a pykv tree (no {MARKER_NAME})") from None
    except (OSError, ValueError) as exc:
        raise NotATreeError(f"{marker}: unreadable tree marker ({exc})") from None
    except RecursionError:  # JSON nested deeper than Python's stack: no marker pykv writes
        raise NotATreeError(f"{marker}: unreadable tree marker (JSON nested too deeply)") from None
    if not isinstance(data, dict):
        raise NotATreeError(f"{marker}: the tree marker is not a JSON object")
    tree_id = data.get("tree_id")
    if isinstance(tree_id, str) and len(tree_id) == 16 and is_hex(tree_id):
        return data, tree_id
    return data, xxhash.xxh3_64_hexdigest(raw)


def check_tree_root(root: Path | str, field: str = ROOT_KEY) -> None:
    """What ``KVTree.create(root, mkdir=False)`` would refuse, changing nothing: a root that is not an
    existing directory, a directory holding other files, a marker that cannot be used."""
    require_root(root, field)
    if os.path.lexists(Path(root) / MARKER_NAME):
        KVTree.open(root)  # NotATreeError for a marker it cannot use
    else:
        refuse_inside_tree(root, field)
        refuse_if_occupied(Path(root), field)


def _exists_at(directory: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=directory, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _require_hex(value: str, what: str) -> None:
    if not is_hex(value):
        raise ValueError(f"{what} must be lowercase hex, got {value!r}")


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems refuse fsync on directories
        if exc.errno not in (errno.EINVAL, errno.EROFS):
            raise
    finally:
        os.close(fd)
