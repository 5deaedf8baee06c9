"""Damage done to a running engine's block files (called from driver ``exec`` steps).

Each kind turns a sound block into something a reader must refuse; all keep the
final name, so the engine's lookup still says "hit" and its load has to catch it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from pykv.format import HEADER_SIZE, decode_header, encode_header

OTHER_NAMESPACE = bytes(range(16))


def header_flip(path: Path, donor: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(113)  # a bit of the token count: header checksum must catch it
        byte = f.read(1)[0]
        f.seek(113)
        f.write(bytes([byte ^ 0x04]))


def truncate(path: Path, donor: Path) -> None:
    os.truncate(path, HEADER_SIZE + 4096)


def zero_length(path: Path, donor: Path) -> None:
    os.truncate(path, 0)


def other_hash(path: Path, donor: Path) -> None:
    """A sound block of another key (same namespace, same shape) under this key's name."""
    shutil.copyfile(donor, path)


def other_namespace(path: Path, donor: Path) -> None:
    """This very block as another namespace would have written it: valid header, other fingerprint."""
    data = bytearray(path.read_bytes())
    header = dataclasses.replace(decode_header(bytes(data[:HEADER_SIZE])), namespace=OTHER_NAMESPACE)
    data[:HEADER_SIZE] = encode_header(header)
    path.write_bytes(bytes(data))


KINDS = {"header-flip": header_flip, "truncated": truncate, "zero-length": zero_length,
         "other-hash": other_hash, "other-namespace": other_namespace}


def published_between(root: str, since: float, until: float) -> list[Path]:
    """Block files whose publication time (mtime) lies in [since, until), by name."""
    out = []
    for directory, dirs, names in os.walk(root):
        if directory == root:
            dirs[:] = [d for d in dirs if d != ".pykv"]
        for name in names:
            path = Path(directory, name)
            if name.endswith(".kv") and since <= path.stat().st_mtime < until:
                out.append(path)
    return sorted(out)


def damage_all(root: str, marks: dict[str, float], kinds: list[str], donor: str) -> dict[str, list[str]]:
    """For each kind, damage every block published between marks ``kind`` and the next mark."""
    order = sorted(marks.items(), key=lambda item: item[1]) + [("end", float("inf"))]
    window = {name: (start, order[i + 1][1]) for i, (name, start) in enumerate(order[:-1])}
    donors = published_between(root, *window[donor])
    victims = {kind: published_between(root, *window[kind]) for kind in kinds}  # before damage moves mtimes
    for kind, files in victims.items():
        for path, donor_path in zip(files, donors):
            KINDS[kind](path, donor_path)
    return {kind: [str(p) for p in files] for kind, files in victims.items()}
