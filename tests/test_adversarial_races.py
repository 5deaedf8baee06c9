"""Adversarial tests for what changes in the tree while a scan runs (docs/adversarial-matrix.md):
entries swapped after a leaf directory was listed and before gc, fsck or an engine's eviction
round acts on them.

The swap happens inside the scan itself (``list_leaf`` is wrapped), so the race is won every
time: a leaf directory becomes a symbolic link to a copy of itself outside the root, a listed
block becomes a FIFO, a hard link of a file outside, or a sparse terabyte with the block's
header. Whatever was swapped in, nothing outside the root changes, nothing blocks, and nothing
pykv did not write is deleted (docs/reliability.md, "Untrusted tree", and its "Left open").
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pykv.blockfile import write_block
from pykv.commands.app import app
from pykv.deviceset import DeviceSet
from pykv.format import Geometry
from pykv.maintenance import catalog as catalog_module
from pykv.maintenance import scan as scan_module
from pykv.maintenance.evictor import EvictionPolicy, TreeEvictor
from pykv.tree import KVTree

from reliability.deadline import deadline
from reliability.rig import NS, key_of, payload_of

GEOMETRY = Geometry(tokens=256, segments=1, segment_bytes=8192)
OLD_NS = 1_000_000_000 * 10**9  # 2001


def run(*argv: object):
    with deadline(30):
        return CliRunner().invoke(app, [str(a) for a in argv])


def tree_with_blocks(root: Path, count: int = 6) -> tuple[KVTree, list[Path]]:
    tree = KVTree.create(root)
    tree.ensure_namespace(NS)
    paths = []
    for i in range(count):
        write_block(tree, NS.id, key_of(i), GEOMETRY, payload_of(key_of(i), GEOMETRY.payload_length))
        path = tree.block_path(NS.id, key_of(i))
        os.utime(path, ns=(OLD_NS, OLD_NS))
        paths.append(path)
    return tree, paths


def snapshot(directory: Path) -> dict[str, tuple]:
    return {str(p.relative_to(directory)): (os.lstat(p).st_ino, os.lstat(p).st_nlink, p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink()}


def swap_link_to_outside(leaf: Path, outside: Path) -> None:
    """The leaf directory becomes a link to a copy of it outside the root (valid blocks there)."""
    copy = outside / "leaf"
    shutil.copytree(leaf, copy)
    for path in copy.iterdir():
        os.utime(path, ns=(OLD_NS, OLD_NS))
    shutil.rmtree(leaf)
    leaf.symlink_to(copy)


def swap_fifo(path: Path, outside: Path) -> None:
    os.unlink(path)
    os.mkfifo(path)
    os.utime(path, ns=(OLD_NS, OLD_NS))


def swap_hard_link(path: Path, outside: Path) -> None:
    kept = outside / "precious.kv"
    shutil.copy(path, kept)  # a valid block, held by someone outside
    os.utime(kept, ns=(OLD_NS, OLD_NS))
    os.unlink(path)
    os.link(kept, path)


def swap_sparse(path: Path, outside: Path) -> None:
    header = path.read_bytes()[:4096]
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(1 << 40)
    os.utime(path, ns=(OLD_NS, OLD_NS))


SWAPS = {"leaf-to-symlink": swap_link_to_outside, "fifo": swap_fifo, "hard-link": swap_hard_link,
         "sparse-terabyte": swap_sparse}


@pytest.fixture
def swap_after_listing(monkeypatch):
    """``arm(leaf, action)``: right after the scan lists ``leaf``, run ``action`` once; ``fired``
    lists the leaves whose action ran (so a test knows the race was run, not skipped)."""
    armed: dict[str, object] = {}
    fired: list[str] = []
    original = scan_module.list_leaf

    def listed(leaf):
        entries = original(leaf)
        action = armed.pop(leaf.path, None)
        if action is not None:
            action()
            fired.append(leaf.path)
        return entries

    monkeypatch.setattr(scan_module, "list_leaf", listed)
    monkeypatch.setattr(catalog_module, "list_leaf", listed)

    def arm(leaf: Path, action) -> None:
        armed[str(leaf)] = action
    arm.fired = fired
    return arm


def prepare(arm, swap: str, victim: Path, outside: Path) -> None:
    """Set up ``swap`` of ``victim``: what lies outside exists before the command runs (so it can be
    compared), and the swap itself happens right after the victim's leaf is listed."""
    if swap == "hard-link":
        swap_hard_link(victim, outside)  # the block is already a link of a file outside
        arm(victim.parent, lambda: None)
    elif swap == "leaf-to-symlink":
        copy = outside / "leaf"
        shutil.copytree(victim.parent, copy)  # valid blocks, under the names gc and fsck look for
        for path in copy.iterdir():
            os.utime(path, ns=(OLD_NS, OLD_NS))

        def relink(leaf=victim.parent):
            shutil.rmtree(leaf)
            leaf.symlink_to(copy)
        arm(victim.parent, relink)
    else:
        arm(victim.parent, lambda: SWAPS[swap](victim, outside))


COMMANDS = {"gc": ["gc", "--max-size", "0", "--min-age", "0"],
            "gc-no-catalog": ["gc", "--max-size", "0", "--min-age", "0", "--no-catalog"],
            "fsck": ["fsck", "--grace", "0"], "fsck-repair": ["fsck", "--repair", "--grace", "0"],
            "inspect": ["inspect"]}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("swap", list(SWAPS))
def test_an_entry_swapped_after_listing_is_never_acted_on_outside(tmp_path, swap_after_listing, swap, command):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = paths[0]
    prepare(swap_after_listing, swap, victim, outside)
    before = snapshot(outside)
    result = run(COMMANDS[command][0], tree.root, *COMMANDS[command][1:])
    assert swap_after_listing.fired == [str(victim.parent)]
    assert result.exit_code in (0, 1), result.output
    assert "Traceback" not in result.output and result.stderr.count("\n") <= 1, result.output
    assert snapshot(outside) == before  # nothing outside written, moved or deleted
    if swap == "leaf-to-symlink":
        assert any(p.is_symlink() for p in tree.root.rglob(victim.parent.name))  # in place or quarantined
    elif swap != "hard-link":
        assert any(tree.root.rglob(victim.name)), "what was swapped in is still under the root"


@pytest.mark.parametrize("swap", list(SWAPS))
def test_an_eviction_round_never_acts_outside_through_a_swap(tmp_path, swap_after_listing, swap):
    tree, paths = tree_with_blocks(tmp_path / "tree")
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = paths[0]
    prepare(swap_after_listing, swap, victim, outside)
    before = snapshot(outside)
    evictor = TreeEvictor(DeviceSet([tree]), EvictionPolicy(1, 0.0, interval_s=3600.0))
    with deadline(30):
        rounds = evictor.run_once()
    assert swap_after_listing.fired == [str(victim.parent)] and len(rounds) == 1
    assert snapshot(outside) == before
    assert not any(p.exists() for p in paths if p.parent != victim.parent)  # the others were evicted
