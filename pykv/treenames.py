"""The names of a pykv tree: its files, directories and temps (one spelling of each, used by the
tree, the maintenance commands and the probes alike)."""

from __future__ import annotations

import os
import re
import secrets
import socket

MARKER_NAME = "pykv-tree.json"
STATE_DIR = ".pykv"
QUARANTINE_DIR = "quarantine"
NAMESPACE_FILE = "namespace.json"
GC_STATE_NAME = "gc.json"
SET_NAME = "set.json"  # in STATE_DIR: the device set the tree serves in (``pykv.membership``)
LEASE_NAME = "evict.lease"  # in STATE_DIR: who evicts now (``pykv.maintenance.lease``)
EVICT_RECORD_NAME = "evict.json"  # in STATE_DIR: the last eviction round (``pykv.maintenance.evict_record``)
PROBE_NAME = "pykv-direct-probe"  # the O_DIRECT probe's file at the root (``pykv.io.probe``)
BLOCK_SUFFIX = ".kv"
TEMP_INFIX = ".tmp."
#: Entries at the root that belong to the filesystem, not to anyone's cache.
ROOT_EXEMPT = frozenset({"lost+found"})
#: The config key an engine's root comes from (named when a root is refused).
ROOT_KEY = "kv_connector_extra_config.root"
#: Why a missing root is refused, said with every refusal.
ROOT_RULE = "pykv never creates a root: a device that did not mount must not become an empty directory"
_HEX = re.compile(r"^[0-9a-f]+\Z")
HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def is_hex(name: str) -> bool:
    """True for a non-empty lowercase hex string (the only names joined into paths)."""
    return bool(_HEX.match(name))


def is_temp_name(name: str) -> bool:
    """True for a temp file left by ``temp_path`` (``<key>.kv.tmp.<host>.<pid>.<rand>``)."""
    return TEMP_INFIX in name and name.split(TEMP_INFIX, 1)[0].endswith(BLOCK_SUFFIX)


def temp_name(base: str) -> str:
    """A unique temp name for a file published as ``base`` (host, pid, random): the one spelling
    of every temp pykv makes, so ``fsck`` recognises what a killed writer left."""
    return f"{base}{TEMP_INFIX}{HOST}.{os.getpid()}.{secrets.token_hex(4)}"


def is_temp_of(name: str, bases: tuple[str, ...]) -> bool:
    """True for ``temp_name(base)`` of one of ``bases``."""
    return TEMP_INFIX in name and name.split(TEMP_INFIX, 1)[0] in bases
