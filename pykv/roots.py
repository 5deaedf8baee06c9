"""The one rule for a tree's root (docs/configuration.md, "Roots"): it must be an existing directory,
outside every other tree, holding nothing pykv did not put there; only ``pykv init`` makes one
(``create_root``), never its parents."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from pykv.errors import NestedTreeError, NotEmptyRootError, RootError
from pykv.io.ancestry import holder_of
from pykv.treenames import MARKER_NAME, PROBE_NAME, ROOT_EXEMPT, ROOT_KEY, ROOT_RULE, STATE_DIR, is_temp_of


def foreign_entries(root: Path | str) -> list[str]:
    """Names at ``root`` that pykv did not put there (sorted): anything but the file system's own
    (``lost+found``), ``.pykv`` and the temps of the marker and the probes."""
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if e.name not in ROOT_EXEMPT and e.name != STATE_DIR
                      and not is_temp_of(e.name, (MARKER_NAME, PROBE_NAME)))


def require_root(root: Path | str, field: str = ROOT_KEY) -> None:
    """``RootError`` naming ``field`` unless ``root`` is an existing directory: the one check of a
    root, one or several, an engine's or a command's (``ROOT_RULE``)."""
    try:
        mode = os.stat(root).st_mode
    except FileNotFoundError:
        if os.path.islink(root):
            raise RootError(f"{field}: {root} is a symbolic link to nothing (a device not mounted?); "
                            f"{ROOT_RULE}") from None
        raise RootError(f"{field}: {root} does not exist; create it with `pykv init {root}` ({ROOT_RULE})") from None
    except NotADirectoryError:
        raise RootError(f"{field}: {root} is not a directory (a component of its path is a file)") from None
    except OSError as exc:
        reason = "a loop of symbolic links" if exc.errno == errno.ELOOP else exc.strerror
        raise RootError(f"{field}: {root} cannot be reached ({reason})") from None
    except ValueError:  # a NUL byte
        raise RootError(f"{field}: {str(root)!r} is not a path") from None
    if not stat.S_ISDIR(mode):
        raise RootError(f"{field}: {root} is not a directory")


def refuse_inside_tree(root: Path | str, field: str = ROOT_KEY) -> None:
    """``NestedTreeError`` if a directory above ``root`` (by ``..``, whatever path or mount named it;
    for a missing ``root``, its parent too) holds a tree marker: a namespace, shard or state directory
    is never a root."""
    exists = os.path.lexists(root)
    try:
        tree = holder_of(root if exists else Path(root).absolute().parent, MARKER_NAME, include_self=not exists)
    except OSError as exc:
        raise RootError(f"{field}: cannot walk up from {root} ({exc.strerror})") from None
    if tree is not None:
        raise NestedTreeError(f"{field}: {root} lies inside the pykv tree {tree} (its namespace, shard or state "
                              f"directories are never a root); give a directory outside every tree")


def create_root(root: Path | str, mode: int = 0o700, field: str = ROOT_KEY) -> bool:
    """Make the directory ``root`` if it is missing (``pykv init``), never its parents: a missing
    parent is a device not mounted or a typo. True if it was made."""
    if os.path.lexists(root):
        require_root(root, field)
        return False
    parent = Path(root).absolute().parent
    if not os.path.isdir(parent):
        raise RootError(f"{field}: the parent of {root} is not an existing directory; pykv init makes one directory, "
                        f"never its parents (a device not mounted? else create {parent} first)")
    refuse_inside_tree(root, field)
    try:
        os.mkdir(root, mode)
    except FileExistsError:  # made meanwhile
        require_root(root, field)
        return False
    except OSError as exc:
        raise RootError(f"{field}: cannot create {root} ({exc.strerror})") from None
    return True


def refuse_if_occupied(root: Path, field: str) -> None:
    """``NotEmptyRootError`` if ``root`` holds anything pykv did not put there."""
    occupied = foreign_entries(root)
    if occupied:
        raise NotEmptyRootError(
            f"{field}: {root} holds files ({len(occupied)} entries, e.g. {occupied[0]!r}) and is not a pykv tree "
            f"(no {MARKER_NAME}); use an empty or new directory, or make this one a tree with 'pykv init {root}'")
