"""Several trees, one per device, that hold one cache: each block lives on exactly one of them.

A block's devices are chosen from its key by rendezvous (highest-random-weight) hashing:
each device scores the key with xxh3-64 seeded by the device's tree identity
(``KVTree.identity``, kept in its marker); the three highest scores are the key's
*candidates* (``candidates``). A store puts the block on one of them, the one its recent
placements used least (``StripedMedium.place``: three choices keep a request's blocks even
over the devices); a lookup checks them in order. No index: every process with the
same set computes the same candidates. Adding a device changes the candidates of the keys
it now scores in the top three; removing one, those of its own keys; a block whose device
dropped out of its candidates is a miss (about 1/N of them either way). The top two are
among the top three, so blocks placed with two choices are found. The set is named
by the identities, so the order of ``roots`` and the mount paths do not matter.

A set, of one root or several, is refused (``InputError`` naming ``roots[i]``) when a
root is missing or not a directory (pykv never creates a root: a device that is not
mounted is never replaced by an empty directory on another filesystem), when two roots
are the same tree (one directory, one inside another, or a copied marker), when a device
serves in another set (``pykv.membership``), or when a root cannot be a tree.
``check_roots`` is that check, for commands to run first. Directories are compared as the
file system knows them (``pykv.io.ancestry``: device and inode, parents by ``..``), never by
path: a bind mount or a symbolic link hides no overlap.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import xxhash

from pykv.errors import InputError, NotATreeError, RootError
from pykv.io.ancestry import lineage
from pykv.membership import SetRecord, check_membership, record_membership
from pykv.namespace import Namespace
from pykv.roots import require_root
from pykv.tree import MARKER_NAME, KVTree, TreeOptions, check_tree_root

log = logging.getLogger(__name__)

ROOTS_KEY = "kv_connector_extra_config.roots"
MAX_DEVICES = 64


CHOICES = 3
"""Candidate devices of a key: a store takes the least used, a lookup checks them in order."""


def rendezvous_index(key: bytes, seeds: Sequence[int]) -> int:
    """The index of the seed that scores ``key`` highest (the first on a tie)."""
    return rendezvous_top(key, seeds, 1)[0]


def rendezvous_top(key: bytes, seeds: Sequence[int], count: int) -> tuple[int, ...]:
    """The indices of the ``count`` seeds that score ``key`` highest, highest first (the first on a tie)."""
    scores = [(-xxhash.xxh3_64_intdigest(key, seed), index) for index, seed in enumerate(seeds)]
    return tuple(index for _, index in sorted(scores)[:count])


class Holds(Protocol):
    """What ``DeviceSet.holding`` asks of each device: a ``KVTree``, or a medium over one."""

    def contains(self, namespace_id: str, key: bytes) -> bool: ...


class DeviceSet:
    """Trees on several devices as one cache; ``candidates(key)`` says which may hold a block."""

    def __init__(self, trees: Sequence[KVTree], *, field: str = ROOTS_KEY) -> None:
        if not trees:
            raise InputError(f"{field}: expected at least one directory")
        if len(trees) > MAX_DEVICES:
            raise InputError(f"{field}: {len(trees)} roots; at most {MAX_DEVICES} devices")
        self._records = _refuse_overlaps(trees, field)
        self.trees = tuple(trees)
        self.seeds = tuple(int(tree.identity, 16) for tree in self.trees)
        # longest first: the first root whose prefix a path has is its own (roots never nest)
        self._prefixes = sorted(((os.path.join(os.fspath(tree.root), ""), i) for i, tree in enumerate(self.trees)),
                                key=lambda item: -len(item[0]))

    @classmethod
    def open(cls, roots: Sequence[Path | str], options: TreeOptions | None = None, *,
             field: str = ROOTS_KEY) -> "DeviceSet":
        """The existing trees at ``roots``; ``NotATreeError`` naming the root at fault."""
        trees = []
        for index, root in enumerate(roots):
            try:
                trees.append(KVTree.open(root, options))
            except NotATreeError as exc:
                raise NotATreeError(f"{_name(field, index, len(roots))}: {exc}") from None
        return cls(trees, field=field)

    @classmethod
    def create(cls, roots: Sequence[Path | str], options: TreeOptions | None = None, *,
               field: str = ROOTS_KEY) -> "DeviceSet":
        """Open ``roots`` as a set, writing each missing marker and each device's set record
        (``record_membership``): what an engine opens. Every root, one or several, must be an
        existing directory (``check_roots``): none is ever created."""
        check_roots(roots, field=field)
        trees = [KVTree.create(root, options, field=_name(field, index, len(roots)), mkdir=False)
                 for index, root in enumerate(roots)]
        devices = cls(trees, field=field)
        record_membership(devices.trees, devices._records)
        devices._warn_shared_filesystems(field)
        return devices

    def index_of(self, key: bytes) -> int:
        """The first of ``key``'s candidates (the device scoring it highest)."""
        return 0 if len(self.seeds) == 1 else rendezvous_index(key, self.seeds)

    def candidates(self, key: bytes) -> tuple[int, ...]:
        """The devices that may hold block ``key`` (the same in every namespace), first choice first:
        the ``CHOICES`` scoring it highest (all of them with fewer devices)."""
        return (0,) if len(self.seeds) == 1 else rendezvous_top(key, self.seeds, CHOICES)

    def tree_of(self, key: bytes) -> KVTree:
        """The tree of ``key``'s first candidate."""
        return self.trees[self.index_of(key)]

    def holding(self, namespace_id: str, key: bytes, *, choices: Sequence[int] | None = None,
                on: Sequence[Holds] | None = None) -> int | None:
        """The first of ``key``'s candidates (``choices``: computed already) whose device holds the block
        published, as ``on[i].contains`` says (default: the trees; a striped medium asks its leaf media);
        None: none does."""
        places: Sequence[Holds] = self.trees if on is None else on
        for index in self.candidates(key) if choices is None else choices:
            if places[index].contains(namespace_id, key):
                return index
        return None

    def holder(self, namespace_id: str, key: bytes) -> KVTree | None:
        """The first of ``key``'s candidate trees that holds the block published (None: none does)."""
        index = self.holding(namespace_id, key)
        return None if index is None else self.trees[index]

    def device_of(self, path: Path | str) -> int:
        """The index of the device whose root ``path`` lies under (``ValueError``: none's)."""
        text = os.fspath(path)
        for prefix, index in self._prefixes:
            if text.startswith(prefix):
                return index
        raise ValueError(f"{text} is on none of the devices")

    def ensure_namespace(self, namespace: Namespace) -> None:
        """The namespace directory and record on every device (``OSError`` of the first that fails,
        after trying them all)."""
        first: OSError | None = None
        for tree in self.trees:
            try:
                tree.ensure_namespace(namespace)
            except OSError as exc:
                first = first or exc
        if first is not None:
            raise first

    @property
    def roots(self) -> tuple[Path, ...]:
        return tuple(tree.root for tree in self.trees)

    def describe(self) -> list[dict[str, str]]:
        """Each device's root and identity, in configuration order (for records and reports)."""
        return [{"root": str(tree.root), "id": tree.identity} for tree in self.trees]

    def __len__(self) -> int:
        return len(self.trees)

    def __iter__(self) -> Iterator[KVTree]:
        return iter(self.trees)

    def __getitem__(self, index: int) -> KVTree:
        return self.trees[index]

    def _warn_shared_filesystems(self, field: str) -> None:
        seen: dict[int, int] = {}
        for index, tree in enumerate(self.trees):
            device = os.stat(tree.root).st_dev
            if device in seen and len(self.trees) > 1:
                log.warning("pykv: %s and %s are on the same filesystem: striping over them adds no bandwidth",
                            _name(field, seen[device], 2), _name(field, index, 2))
            seen.setdefault(device, index)


def _name(field: str, index: int, count: int) -> str:
    return f"{field}[{index}]" if count > 1 else field


def overlapping_roots(roots: Sequence[Path | str], *, field: str = ROOTS_KEY) -> tuple[int, int, int | None] | None:
    """The first pair ``(j, i, inner)``, ``j < i``, of existing directories that are one directory
    (``inner`` None) or one inside the other (``inner``: the index of the one inside), by device and
    inode (``lineage``), whatever paths name them; ``RootError`` naming a root it cannot walk up from."""
    if len(roots) < 2:
        return None
    chains = []
    for index, root in enumerate(roots):
        try:
            chains.append(lineage(root))
        except OSError as exc:
            raise RootError(f"{_name(field, index, len(roots))}: cannot walk up from {root} to / "
                            f"({exc.strerror})") from None
    for i in range(len(roots)):
        for j in range(i):
            if chains[i][0] == chains[j][0]:
                return j, i, None
            if chains[j][0] in chains[i] or chains[i][0] in chains[j]:
                return j, i, i if chains[j][0] in chains[i] else j
    return None


def check_roots(roots: Sequence[Path | str], *, field: str = ROOTS_KEY) -> None:
    """What ``DeviceSet.create`` refuses, checked without changing anything (``pykv config``, ``serve``,
    ``warm`` and ``demo`` run it before an engine does): roots that overlap, a root that is not an
    existing directory (``require_root``), holds other files or has an unusable marker, two copies of
    one tree, a device of another set."""
    require_roots(roots, field=field)
    for index, root in enumerate(roots):
        check_tree_root(root, _name(field, index, len(roots)))
    marked = [index for index, root in enumerate(roots) if os.path.lexists(Path(root) / MARKER_NAME)]
    _refuse_shared([KVTree.open(roots[index]) for index in marked],
                   [_name(field, index, len(roots)) for index in marked])


def require_roots(roots: Sequence[Path | str], *, field: str = ROOTS_KEY) -> None:
    """Roots that are each an existing directory (``require_root``: never created) and do not overlap."""
    for index, root in enumerate(roots):
        require_root(root, _name(field, index, len(roots)))
    _refuse_nested(roots, field)


def _refuse_nested(roots: Sequence[Path | str], field: str) -> None:
    """Two roots that are one directory or one inside the other (checked before anything is created)."""
    pair = overlapping_roots(roots, field=field)
    if pair is not None:
        j, i, inner = pair
        outer = j if inner == i else i
        how = ("they are one directory (a bind mount, a symbolic link or the same path twice)" if inner is None
               else f"{roots[inner]} lies inside {roots[outer]}")
        raise InputError(f"{_name(field, j, 2)} and {_name(field, i, 2)}: {roots[j]} and {roots[i]} overlap: {how}; "
                         f"give each device's tree once")


def _refuse_overlaps(trees: Sequence[KVTree], field: str) -> list[SetRecord | None]:
    """Two roots that overlap (``_refuse_nested``), are one tree (a copied marker) or serve in other
    sets (``check_membership``); each tree's set record."""
    _refuse_nested([tree.root for tree in trees], field)
    return _refuse_shared(trees, [_name(field, index, len(trees)) for index in range(len(trees))])


def _refuse_shared(trees: Sequence[KVTree], names: Sequence[str]) -> list[SetRecord | None]:
    """Two trees with one identity (a copied marker) or that never served in one set; each's record."""
    owner: dict[str, int] = {}
    for i, tree in enumerate(trees):
        other = owner.setdefault(tree.identity, i)
        if other != i:
            raise InputError(f"{names[other]} and {names[i]}: {trees[other].root} and "
                             f"{tree.root} are copies of one tree (identity {tree.identity}); give the copy a tree of its "
                             f"own: remove its {MARKER_NAME} and run 'pykv init {tree.root}'")
    return check_membership(trees, names)
