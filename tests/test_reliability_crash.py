"""Crash consistency: writers SIGKILLed at random moments never leave a partial file under a final name.

A forked child stores blocks in a loop, through the real reactor (io_uring or the
thread pool, O_DIRECT, with and without fsync) or through ``write_block``, until the
parent kills it with SIGKILL after 50-300 ms. After every kill each final-named
block must be exactly the bytes its key's store writes; at the end ``pykv fsck``
(grace 0) finds nothing but stale temps, ``--repair`` removes all of them, and a
reactor loads every surviving block (the engine's own load path) without an error.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.format import HEADER_SIZE
from pykv.io.probe import direct_io_supported
from pykv.tree import KVTree, TreeOptions, is_temp_name

from reliability.rig import NS, Rig, block_files, expected_file, geometry_of, key_of, payload_of, temp_files

ITERATIONS = 200
KEYS = 64
MIN_BYTES, MAX_BYTES = 3000, 512 * 1024


def keys_and_geometries(rng: random.Random, n: int):
    keys = [key_of(rng.randrange(KEYS)) for _ in range(n)]
    return keys, [geometry_of(k, MIN_BYTES, MAX_BYTES) for k in keys]


def storer(root: Path, seed: int, direct: bool) -> None:
    """The child: store until killed. Never returns."""
    try:
        rng = random.Random(seed)
        options = TreeOptions(fsync=seed % 4 == 0)
        if seed % 3 == 2:  # the synchronous tool path
            from pykv.blockfile import write_block
            tree = KVTree(root, options)
            while True:
                (k,), (g,) = keys_and_geometries(rng, 1)
                write_block(tree, NS.id, k, g, payload_of(k, g.payload_length))
        backend = "io_uring" if seed % 3 == 0 else "threadpool"
        rig = Rig(root, backend=backend, max_payload=MAX_BYTES, slots=6, create=False, options=options,
                  direct=direct, keep_payloads=False)
        while True:
            rig.store(*keys_and_geometries(rng, rng.randint(1, 6)))
    finally:
        os._exit(0)


def assert_final_files_are_whole(root: Path) -> int:
    """Every final-named file holds exactly its key's bytes (creation time and header checksum aside)."""
    files = block_files(root)
    for path in files:
        data = Path(path).read_bytes()
        key = bytes.fromhex(Path(path).name[:-3])
        want = expected_file(NS, key, geometry_of(key, MIN_BYTES, MAX_BYTES))
        assert len(data) == len(want), f"{path}: {len(data)} bytes, a whole block has {len(want)}"
        assert data[:144] == want[:144] and data[160:] == want[160:], f"{path}: not the bytes that were stored"
        assert data[160:HEADER_SIZE] == bytes(HEADER_SIZE - 160)
    return len(files)


def test_sigkilled_writers_leave_only_whole_blocks_and_temps_that_fsck_removes(tmp_path):
    root = tmp_path / "tree"
    tree = KVTree.create(root)
    tree.ensure_namespace(NS)
    direct = direct_io_supported(root)[0]
    rng = random.Random(1234)
    kills_with_temps = published = 0
    seen: set[str] = set()
    started = time.monotonic()
    for iteration in range(ITERATIONS):
        pid = os.fork()
        if pid == 0:
            storer(root, iteration, direct)
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child ended early: {status}"
        assert_final_files_are_whole(root)
        temps = temp_files(root)
        kills_with_temps += bool(temps)
        files = block_files(root)
        published += len(set(files) - seen)
        deleted = rng.sample(files, len(files) // 2)
        for path in deleted:  # make room, as gc would, so writers keep publishing
            os.unlink(path)
        seen = set(files) - set(deleted)
    elapsed = time.monotonic() - started
    print(f"{ITERATIONS} kills in {elapsed:.0f}s: {published} new final files seen, "
          f"{kills_with_temps} kills left temp files behind")
    assert published >= ITERATIONS  # the children did publish between kills
    assert kills_with_temps >= ITERATIONS // 10  # and were often killed in the middle of a write

    runner = CliRunner()
    leftovers = temp_files(root)
    check = runner.invoke(app, ["fsck", str(root), "--grace", "0", "--json"])
    report = json.loads(check.stdout)
    assert check.exit_code == (1 if leftovers else 0), check.output
    assert {f["problem"] for f in report["findings"]} <= {"stale-temp"}, report["findings"]
    assert len(report["findings"]) == len(leftovers)
    assert all(is_temp_name(Path(f["path"]).name) for f in report["findings"])

    repaired = runner.invoke(app, ["fsck", str(root), "--repair", "--grace", "0"])
    assert repaired.exit_code == 0, repaired.output
    assert temp_files(root) == []
    assert runner.invoke(app, ["fsck", str(root), "--grace", "0"]).exit_code == 0

    survivors = [bytes.fromhex(Path(p).name[:-3]) for p in block_files(root)]
    assert survivors
    with Rig(root, max_payload=MAX_BYTES, create=False) as rig:
        loaded = rig.load(survivors, [geometry_of(k, MIN_BYTES, MAX_BYTES) for k in survivors])
    assert loaded.result.ok, loaded.result.failed
    assert not loaded.mismatched and len(loaded.delivered) == len(survivors)
