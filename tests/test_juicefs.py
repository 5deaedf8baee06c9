"""A shared tree on a distributed file system: one JuiceFS volume, three clients (tests/juicefs_volume.py).

Each mount is its own client with its own caches, standing in for a node of a Lustre, NFS
or CephFS cluster: publication by hard link must stay atomic across clients (one winner,
the rest EEXIST), a block one client wrote must check on another, and fsck and gc run from
a third client while two write must neither report damage nor delete a block that was just
published (gc's --min-age).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
import traceback
from pathlib import Path

import pytest
import xxhash
from juicefs_volume import juicefs_volume, unavailable_reason
from typer.testing import CliRunner

from pykv.blockfile import check_block, read_payload, write_block
from pykv.commands.app import app
from pykv.errors import FormatError
from pykv.format import Geometry
from pykv.maintenance.doctor import ProbeRefused, Verdict, diagnose
from pykv.maintenance.scan import Kind, Scan
from pykv.namespace import Namespace
from pykv.tree import KVTree, is_temp_name
from reliability.racing import contend_for_lease, race

NS = Namespace(model="juicefs/test", dtype="bfloat16", kv_layout="NHD", tokens_per_block=16)
RACE_KEYS = 60
GC_LIMIT = 1 << 20
MIN_AGE_S = 3.0
WRITE_SECONDS = 6.0


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with juicefs_volume(tmp_path_factory.mktemp("juicefs")) as volume:
        yield volume


def on(volume, client: int, name: str) -> Path:
    return volume.mounts[client] / name


def key_of(label: str) -> bytes:
    return xxhash.xxh3_128_digest(label.encode())


def block_of(key: bytes) -> tuple[Geometry, bytes]:
    """The same bytes for a key in every process; 32-96 KiB, several JuiceFS pages."""
    geometry = Geometry(tokens=16, segments=2, segment_bytes=16384 * (1 + key[0] % 3))
    return geometry, (key * (geometry.payload_length // 16 + 1))[:geometry.payload_length]


def new_tree(volume, name: str) -> list[KVTree]:
    """A tree made on client 0, opened on every client."""
    KVTree.create(on(volume, 0, name)).ensure_namespace(NS)
    return [KVTree.open(point / name) for point in volume.mounts]


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


# -- the file system itself --------------------------------------------------------------------
def test_a_link_made_on_one_client_is_seen_on_another_and_a_second_link_gets_eexist(volume):
    a, b = on(volume, 0, "links"), on(volume, 1, "links")
    a.mkdir()
    (a / "first").write_bytes(b"first")
    os.link(a / "first", a / "published")
    assert (b / "published").read_bytes() == b"first"
    (b / "second").write_bytes(b"second")
    with pytest.raises(FileExistsError):
        os.link(b / "second", b / "published")
    assert (a / "published").read_bytes() == b"first" and os.stat(a / "published").st_nlink == 2


def test_a_block_written_on_one_client_checks_on_the_others(volume):
    trees = new_tree(volume, "across")
    key = key_of("across")
    geometry, payload = block_of(key)
    assert not trees[1].contains(NS.id, key)  # a negative lookup first: it must not hide the publication
    assert write_block(trees[0], NS.id, key, geometry, payload)
    for tree in trees[1:]:
        assert tree.contains(NS.id, key)
        checked = check_block(tree.block_path(NS.id, key))
        assert checked.header.key == key and checked.header.geometry == geometry
        assert read_payload(tree.block_path(NS.id, key))[1] == payload
        assert os.stat(tree.block_path(NS.id, key)).st_nlink == 1  # gc deletes only files with one link
    assert not write_block(trees[1], NS.id, key, geometry, payload)  # already there: the second writer loses


def test_an_atime_stamped_on_one_client_reaches_the_others(volume):
    trees = new_tree(volume, "stamped")
    key = key_of("stamped")
    assert write_block(trees[0], NS.id, key, *block_of(key))
    path_b = trees[1].block_path(NS.id, key)
    published = os.stat(path_b)
    old = published.st_mtime_ns - 3 * 86400 * 10**9
    os.utime(path_b, ns=(old, published.st_mtime_ns))  # as gc's order sees a block not hit for 3 days
    read_payload(trees[2].block_path(NS.id, key))  # a read alone (noatime) changes nothing
    assert trees[2].touch(trees[2].block_path(NS.id, key))  # a hit on client 2
    deadline = time.monotonic() + 5
    while os.stat(trees[0].block_path(NS.id, key)).st_atime_ns <= old and time.monotonic() < deadline:
        time.sleep(0.1)  # client 0's attribute cache (1 s)
    seen = os.stat(trees[0].block_path(NS.id, key))
    assert seen.st_atime_ns > old + 86400 * 10**9 and seen.st_mtime_ns == published.st_mtime_ns


# -- racing publishers ---------------------------------------------------------------------------
def publish_keys(root: str, seed: int, start, results) -> None:
    """Writer: every race key, in an order of its own; reports (won, lost, errors)."""
    won, lost, errors = 0, 0, []
    try:
        tree = KVTree.open(root)
        keys = [key_of(f"race-{i}") for i in range(RACE_KEYS)]
        random.Random(seed).shuffle(keys)
        start.wait(timeout=60)
        for key in keys:
            geometry, payload = block_of(key)
            if write_block(tree, NS.id, key, geometry, payload):
                won += 1
            else:
                lost += 1
    except Exception:  # noqa: BLE001 - reported to the parent
        errors.append(traceback.format_exc())
    results.put(("writer", seed, won, lost, errors))


def read_while_racing(root: str, seed: int, start, stop, results) -> None:
    """Reader: any race key whose final name exists must be whole and right (never partial)."""
    checked, errors = 0, []
    try:
        tree = KVTree.open(root)
        keys = [key_of(f"race-{i}") for i in range(RACE_KEYS)]
        start.wait(timeout=60)
        rng = random.Random(seed)
        while not stop.is_set():
            key = rng.choice(keys)
            if tree.contains(NS.id, key):
                try:
                    if read_payload(tree.block_path(NS.id, key))[1] != block_of(key)[1]:
                        errors.append(f"{key.hex()}: wrong payload")
                    checked += 1
                except (FormatError, OSError) as exc:
                    errors.append(f"{key.hex()}: {exc}")
    except Exception:  # noqa: BLE001
        errors.append(traceback.format_exc())
    results.put(("reader", seed, checked, 0, errors))


def test_racing_publishers_on_two_clients_one_wins_readers_never_see_a_partial_block(volume):
    trees = new_tree(volume, "race")
    ctx = multiprocessing.get_context("spawn")
    start, stop, results = ctx.Barrier(4), ctx.Event(), ctx.Queue()
    writers = [ctx.Process(target=publish_keys, args=(str(trees[i].root), i, start, results)) for i in (0, 1)]
    readers = [ctx.Process(target=read_while_racing, args=(str(trees[i].root), 10 + i, start, stop, results))
               for i in (0, 1)]
    for process in writers + readers:
        process.start()
    try:
        reports = [results.get(timeout=240) for _ in writers]
        stop.set()
        reports += [results.get(timeout=60) for _ in readers]
    finally:
        stop.set()
        for process in writers + readers:
            process.join(timeout=60)
    assert [p.exitcode for p in writers + readers] == [0, 0, 0, 0]
    assert [e for *_, errors in reports for e in errors] == []
    written = [r for r in reports if r[0] == "writer"]
    assert all(won + lost == RACE_KEYS for _, _, won, lost, _ in written)
    assert sum(won for _, _, won, _, _ in written) == RACE_KEYS  # exactly one winner per key
    assert all(checked > 0 for kind, _, checked, _, _ in reports if kind == "reader")
    for tree in trees:  # every client sees every block, whole, once, and no temp
        scan = Scan.of(tree)
        assert len(scan.of_kind(Kind.BLOCK)) == RACE_KEYS and scan.of_kind(Kind.TEMP) == []
        for i in range(RACE_KEYS):
            key = key_of(f"race-{i}")
            assert read_payload(tree.block_path(NS.id, key))[1] == block_of(key)[1]


# -- a writer killed mid-block ---------------------------------------------------------------------
def write_half_and_wait(root: str, key: bytes, ready) -> None:
    """Start a block's temp, write half of it, then wait to be killed."""
    tree = KVTree.open(root)
    final = tree.block_path(NS.id, key)
    tree.ensure_parent(final)
    geometry, payload = block_of(key)
    with open(tree.temp_path(final), "xb") as f:
        f.write(payload[: len(payload) // 2])
        f.flush()
        os.fsync(f.fileno())
        ready.set()
        time.sleep(120)


def test_a_writer_killed_mid_block_leaves_no_block_and_fsck_on_another_client_removes_its_temp(volume):
    trees = new_tree(volume, "killed")
    key = key_of("killed")
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    writer = ctx.Process(target=write_half_and_wait, args=(str(trees[0].root), key, ready))
    writer.start()
    try:
        assert ready.wait(timeout=60)
    finally:
        writer.kill()
        writer.join(timeout=30)
    assert [tree.contains(NS.id, key) for tree in trees] == [False, False, False]
    result = cli("fsck", trees[2].root, "--grace", "0s", "--repair", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [f["problem"] for f in report["findings"]] == ["stale-temp"] and len(report["deleted"]) == 1
    assert [p for p in trees[1].root.rglob("*") if is_temp_name(p.name)] == []
    assert cli("fsck", trees[1].root).exit_code == 0


# -- maintenance from a third client while two write ----------------------------------------------
def write_for_a_while(root: str, label: str, seconds: float, results) -> None:
    """Writer: new blocks for ``seconds``; after each, every block it published less than half of
    gc's --min-age ago must still be there and whole (gc may delete only older ones)."""
    published, recent, errors = 0, [], []
    try:
        tree = KVTree.open(root)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            key = key_of(f"{label}-{published}")
            geometry, payload = block_of(key)
            assert write_block(tree, NS.id, key, geometry, payload)
            published += 1
            now = time.monotonic()
            recent = [(k, t) for k, t in recent if now - t < MIN_AGE_S / 2] + [(key, now)]
            for k, _ in recent:
                try:
                    check_block(tree.block_path(NS.id, k))
                except (FormatError, OSError) as exc:
                    errors.append(f"{k.hex()} published {now - _:.1f} s ago: {exc}")
    except Exception:  # noqa: BLE001
        errors.append(traceback.format_exc())
    results.put((label, published, errors))


def test_gc_and_fsck_from_a_third_client_while_two_write(volume):
    trees = new_tree(volume, "maintained")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    writers = [ctx.Process(target=write_for_a_while, args=(str(trees[i].root), f"w{i}", WRITE_SECONDS, results))
               for i in (0, 1)]
    for process in writers:
        process.start()
    runs, freed = [], 0
    try:
        deadline = time.monotonic() + WRITE_SECONDS
        while time.monotonic() < deadline or any(p.is_alive() for p in writers):
            gc = cli("gc", trees[2].root, "--max-size", str(GC_LIMIT), "--min-age", f"{MIN_AGE_S:.0f}s", "--json")
            runs.append(("gc", gc.exit_code, gc.output))
            if gc.exit_code == 0:
                freed += json.loads(gc.stdout)["freed_files"]
            fsck = cli("fsck", trees[2].root, "--json")
            runs.append(("fsck", fsck.exit_code, fsck.output))
            if not any(p.is_alive() for p in writers):
                break
        reports = [results.get(timeout=120) for _ in writers]
    finally:
        for process in writers:
            process.join(timeout=60)
    assert [p.exitcode for p in writers] == [0, 0]
    assert [e for _, _, errors in reports for e in errors] == []
    assert [(kind, code, out) for kind, code, out in runs if code != 0] == []  # fsck clean throughout
    assert freed > 0, "gc never had anything old enough to delete: the writers wrote too little"
    assert sum(published for _, published, _ in reports) > freed
    time.sleep(MIN_AGE_S)
    final = cli("gc", trees[2].root, "--max-size", str(GC_LIMIT), "--min-age", "0s")
    assert final.exit_code == 0, final.output
    for tree in trees:  # every client agrees the limit holds and the tree is clean
        assert sum(e.size for e in Scan.of(tree).of_kind(Kind.BLOCK)) <= GC_LIMIT
        assert cli("fsck", tree.root).exit_code == 0


# -- the eviction lease across clients ------------------------------------------------------------
def settled_lease_holder(tree: KVTree) -> str | None:
    """The lease's holder as ``tree``'s client sees it once its caches (1 s) have expired."""
    from pykv.maintenance.lease import read_lease
    time.sleep(1.5)
    lease = read_lease(tree)
    return None if lease is None else lease.holder


def test_the_eviction_lease_has_one_holder_across_clients_and_a_stale_one_is_taken_over(volume):
    from pykv.maintenance.lease import Lease
    trees = new_tree(volume, "leased")
    reports, _ = race(contend_for_lease, [(str(trees[i].root), f"client{i}") for i in range(3)])
    assert [error for _, _, error in reports] == ["", "", ""]
    [winner] = [holder for holder, won, _ in reports if won]  # link(2) across clients: one winner
    assert {settled_lease_holder(tree) for tree in trees} == {winner}
    late = Lease(trees[2], "late", ttl_s=30, clock=lambda: time.time() + 60)  # the winner's lease has expired
    assert late.acquire()
    assert {settled_lease_holder(tree) for tree in trees} == {"late"}
    late.release()
    assert {settled_lease_holder(tree) for tree in trees} == {None}


def test_an_engine_on_one_client_evicts_while_another_clients_lease_makes_it_wait(volume):
    from pykv.deviceset import DeviceSet
    from pykv.maintenance.evictor import EvictionPolicy, TreeEvictor
    from pykv.maintenance.lease import Lease
    trees = new_tree(volume, "evicted")
    for i in range(24):
        key = key_of(f"evict-{i}")
        write_block(trees[0], NS.id, key, *block_of(key))
    total = sum(e.size for e in Scan.of(trees[0]).of_kind(Kind.BLOCK))
    limit = total // 2
    holder = Lease(trees[0], "client0", ttl_s=30)
    assert holder.acquire()
    evictor = TreeEvictor(DeviceSet([trees[1]]), EvictionPolicy(limit, 0.0, 3600.0))
    time.sleep(1.5)  # client 1's caches may still miss the fresh lease for a second: the test is of the lease
    assert evictor.run_once() == [None]  # client 0 holds the lease: client 1 skips, deletes nothing
    assert sum(e.size for e in Scan.of(trees[2]).of_kind(Kind.BLOCK)) == total
    holder.release()
    time.sleep(1.5)
    [result] = evictor.run_once()
    assert result is not None and result.freed_files > 0 and result.after_bytes <= EvictionPolicy(limit, 0, 1).low_water
    time.sleep(1.5)
    for tree in trees:  # every client sees the tree under the limit, clean
        assert sum(e.size for e in Scan.of(tree).of_kind(Kind.BLOCK)) <= limit
        assert cli("fsck", tree.root).exit_code == 0


# -- pykv doctor ---------------------------------------------------------------------------------
def test_doctor_on_a_juicefs_tree(volume):
    trees = new_tree(volume, "doctored")
    report = diagnose(trees[1].root, environ={"PYTHONHASHSEED": "0"})
    verdicts = {d.item: d.verdict for d in report.diagnoses}
    assert report.of("mount").detail.startswith("fuse.juicefs ") and "shared between nodes" in report.of("mount").detail
    for item in ("tree", "publish", "rename", "dir_fsync", "atime", "clock", "o_direct", "space", "hash_seed"):
        assert verdicts[item] is Verdict.OK, report.of(item)
    assert not report.failed
    assert sorted(p.name for p in trees[0].root.iterdir()) == sorted(p.name for p in trees[1].root.iterdir())
    with pytest.raises(ProbeRefused, match=r"\.(accesslog|config|stats|trash)"):
        diagnose(volume.mounts[0])  # the mount's root holds JuiceFS's own entries: use a directory in it
