"""Which device set a tree serves in: ``.pykv/set.json``, so that a device of another set is refused.

The marker names a tree; this record names the set the tree last served in with an engine: the
tree's own identity and the identities of the set's members (``{"tree_id": ..., "members": [...]}``,
sorted: the order of roots does not matter). ``DeviceSet.create`` writes it on every device of a
set of two or more when it differs; every other reader only checks it (``check_membership``):

* a record that names another tree than the marker beside it: the marker was copied over this
  device from another one (``pykv init`` of a new marker drops the old record);
* two devices whose records show they never served together (neither lists the other): a device
  of another set plugged into this one.

A device added to a set has no record yet, one removed is simply absent from the newer records,
and a tree without a record (older pykv, one root only) is accepted as before. To join a device of
another set on purpose, remove its ``.pykv/set.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Sequence

from pykv.errors import MembershipError
from pykv.io.safe_paths import directory_fd, open_regular
from pykv.io.small_files import replace_small
from pykv.tree import SET_NAME, STATE_DIR, KVTree, is_hex

log = logging.getLogger(__name__)

RECORD_LIMIT = 4096  # 64 devices of 16 hex digits, with room to spare
MAX_MEMBERS = 64


@dataclass(frozen=True)
class SetRecord:
    """A device's ``set.json``: its own identity and its set's members when an engine last opened it."""

    tree_id: str
    members: frozenset[str]

    def encode(self) -> bytes:
        return json.dumps({"tree_id": self.tree_id, "members": sorted(self.members)}, indent=2).encode()


def read_record(tree: KVTree) -> SetRecord | None:
    """``tree``'s record (None: none, or no ``.pykv`` directory to hold one: a planted link there is
    fsck's to report); ``MembershipError`` for a record that is not what pykv writes."""
    where = tree.state_dir / SET_NAME
    with contextlib.ExitStack() as stack:
        try:
            state = stack.enter_context(directory_fd(tree.root, STATE_DIR))
        except OSError:
            return None
        try:
            with open_regular(SET_NAME, limit=RECORD_LIMIT, dir_fd=state) as opened:
                raw = opened.read(RECORD_LIMIT + 1, 0)
            data = json.loads(raw)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise MembershipError(f"{where}: unreadable device set record ({reason}); remove it") from None
    tree_id = data.get("tree_id") if isinstance(data, dict) else None
    members = data.get("members") if isinstance(data, dict) else None
    if not (_is_id(tree_id) and isinstance(members, list) and 0 < len(members) <= MAX_MEMBERS
            and all(_is_id(member) for member in members)):
        raise MembershipError(f"{where}: not a device set record (tree_id and members, 16 hex digits each); remove it")
    return SetRecord(tree_id, frozenset(members))


def check_membership(trees: Sequence[KVTree], names: Sequence[str]) -> list[SetRecord | None]:
    """Each tree's record, after refusing (``MembershipError`` naming ``names``) a record of another
    tree or two trees that never served in one set."""
    records = [read_record(tree) for tree in trees]
    for i, (tree, record) in enumerate(zip(trees, records)):
        if record is not None and record.tree_id != tree.identity:
            raise MembershipError(
                f"{names[i]}: {tree.root}'s marker names tree {tree.identity} but its {STATE_DIR}/{SET_NAME} was "
                f"written for tree {record.tree_id}: a marker copied from another device? put its own marker back, "
                f"or make it a new tree: remove its marker and run 'pykv init {tree.root}'")
        for j in range(i):
            other = records[j]
            if (record is not None and other is not None and trees[j].identity not in record.members
                    and tree.identity not in other.members):
                raise MembershipError(
                    f"{names[j]} and {names[i]}: {trees[j].root} and {tree.root} belong to different device sets "
                    f"(neither's {STATE_DIR}/{SET_NAME} lists the other): a device of another set? to move one into "
                    f"this set, remove its {STATE_DIR}/{SET_NAME}")
    return records


def record_membership(trees: Sequence[KVTree], records: Sequence[SetRecord | None]) -> None:
    """Write the set of ``trees`` into each device's record that differs (sets of two or more). A
    device where it cannot be written (a read-only mount) keeps its old record, with a warning."""
    if len(trees) < 2:
        return
    members = frozenset(tree.identity for tree in trees)
    for tree, old in zip(trees, records):
        record = SetRecord(tree.identity, members)
        if old == record:
            continue
        try:
            with directory_fd(tree.root, STATE_DIR, create_mode=tree.options.dir_mode) as fd:
                replace_small(SET_NAME, record.encode(), tree.options.file_mode, dir_fd=fd)
        except OSError as exc:
            log.warning("pykv: could not record the device set in %s: %s", tree.state_dir / SET_NAME, exc)


def _is_id(value: object) -> bool:
    return isinstance(value, str) and len(value) == 16 and is_hex(value)
