"""Hostile content: planted pickles are never deserialized, planted symlinks never followed, only hex
names become paths, and everything pykv creates is private to the user unless configured otherwise."""

from __future__ import annotations

import ast
import errno
import os
import pickle
import shutil
import stat
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pykv.blockfile import check_block, write_block
from pykv.commands.app import app
from pykv.format import Geometry
from pykv.maintenance import fsck, inspect_tree, repair, run_gc
from pykv.tree import KVTree, TreeOptions

from reliability.rig import NS, Rig, block_files, key_of, payload_of

REPO = Path(__file__).resolve().parents[1]
GEOMETRY = Geometry(tokens=256, segments=2, segment_bytes=6000)
OLD_NS = 1_000_000_000 * 10**9  # an atime in 2001: any read would move it (relatime)
ELOOP = os.strerror(errno.ELOOP)


class Plant:
    """Unpickling this creates ``path``: the payload of a malicious cache file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_payload(marker: Path) -> bytes:
    return pickle.dumps(Plant(marker), protocol=4)


# -- pickles ------------------------------------------------------------------------------------

def test_a_pickle_payload_is_moved_as_bytes_and_never_unpickled(tmp_path):
    control = tmp_path / "control"
    pickle.loads(pickle_payload(control))  # the payload is live: unpickling it creates a file
    assert control.exists()
    marker = tmp_path / "pwned"
    data = pickle_payload(marker)
    geometry = Geometry(tokens=256, segments=1, segment_bytes=len(data))
    key = key_of(1)
    with Rig(tmp_path / "tree") as rig:
        # a well-formed block whose payload is the pickle, and a file that is the pickle and nothing else
        write_block(rig.tree, NS.id, key, geometry, data)
        rig.path(key_of(2)).parent.mkdir(parents=True, exist_ok=True)
        rig.path(key_of(2)).write_bytes(data * 100)
        loaded = rig.load([key, key_of(2)])
        assert loaded.delivered[0] == data  # raw bytes, as KV
        assert "bad magic" in str(loaded.result.failed[1]) and loaded.result.failed[1].corrupt
        check_block(rig.path(key))
        report = fsck(rig.tree, grace_s=0)
        assert [f.problem.value for f in report.findings] == ["bad-header"]
        repair(rig.tree, report)
        inspect_tree(rig.tree)
        run_gc(rig.tree, 0, min_age_s=0)
        assert not block_files(rig.tree.root)
    for command in (["inspect", tmp_path / "tree"], ["fsck", tmp_path / "tree"]):
        CliRunner().invoke(app, [str(a) for a in command])
    assert not marker.exists()


def test_the_connector_copies_a_pickle_payload_into_kv_and_never_unpickles_it(tmp_path):
    pytest.importorskip("vllm")
    from reliability.connector_rig import BPC, PAGE, chunk_keys, connector

    marker = tmp_path / "pwned"
    c = connector(str(tmp_path / "tree"))
    try:
        key = chunk_keys(1, salt=9)[0]
        c.store([key])
        path = c.worker.devices[0].block_path(c.worker.namespace.id, key)
        header = check_block(path).header
        payload = (pickle_payload(marker) * (header.payload_length // 50 + 1))[:header.payload_length]
        os.unlink(path)
        write_block(c.worker.devices[0], c.worker.namespace.id, key, header.geometry, payload)
        failed, _ = c.load([key], first_block=40)
        assert not failed
        assert bytes(c.kv[0][40:40 + BPC].numpy().tobytes()) == payload[:BPC * PAGE]
    finally:
        c.close()
    assert not marker.exists()


FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "joblib", "cloudpickle", "yaml"}


def _forbidden_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("eval", "exec", "torch.load", "torch.serialization.load", "__import__"):
                found.append(name)
            if name.endswith(("np.load", "numpy.load")) and any(
                    k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                    for k in node.keywords):
                found.append(f"{name}(allow_pickle=...)")
    return found


def test_no_deserializer_of_code_anywhere_in_pykv():
    sources = list((REPO / "pykv").rglob("*.py"))
    assert len(sources) > 30
    offenders = {}
    for path in sources:
        found = _forbidden_calls(ast.parse(path.read_text(), filename=str(path)))
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}


def test_the_source_scan_would_catch_them():
    code = "import pickle\nfrom yaml import load\ntorch.load(f)\nnp.load(f, allow_pickle=True)\neval(s)\n"
    assert _forbidden_calls(ast.parse(code)) == ["pickle", "yaml", "torch.load", "np.load(allow_pickle=...)", "eval"]


# -- symlinks -----------------------------------------------------------------------------------

def outside_block(tmp_path: Path, name: str, key: bytes) -> Path:
    """A valid block for ``key`` outside the tree (what a followed link would deliver), atime in 2001."""
    directory = tmp_path / "outside" / name
    directory.mkdir(parents=True)
    path = directory / f"{key.hex()}.kv"
    from pykv.blockfile import encode_block
    path.write_bytes(encode_block(NS.fingerprint, key, GEOMETRY, payload_of(key, GEOMETRY.payload_length)))
    os.utime(path, ns=(OLD_NS, time.time_ns() - 7200 * 10**9))
    return path


def snapshot(path: Path) -> tuple[bytes, int]:
    st = os.stat(path)
    with open(path, "rb") as f:  # read without touching atime would need O_NOATIME: restore it afterwards
        data = f.read()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return data, st.st_atime_ns


def intact(path: Path, before: tuple[bytes, int]) -> bool:
    """Same bytes and an atime nobody moved (the atime is read first: reading moves it)."""
    atime = os.stat(path).st_atime_ns
    return atime == before[1] and snapshot(path)[0] == before[0]


@pytest.mark.parametrize("backend", ["io_uring", "threadpool"])
@pytest.mark.parametrize("where", ["block", "leaf-shard", "upper-shard", "namespace"])
def test_a_planted_symlink_fails_the_load_with_eloop_and_no_store_goes_through_it(tmp_path, backend, where):
    key = key_of(5)
    with Rig(tmp_path / "tree", backend=backend) as rig:
        final = rig.path(key)
        level = {"block": final, "leaf-shard": final.parent, "upper-shard": final.parent.parent,
                 "namespace": final.parent.parent.parent}[where]
        target = outside_block(tmp_path, "target", key)
        # the link points where following it would find a valid block of the key
        link_target = {"block": target, "leaf-shard": target.parent}.get(where)
        if where == "upper-shard":
            (tmp_path / "outside" / "upper" / final.parent.name).mkdir(parents=True)
            os.link(target, tmp_path / "outside" / "upper" / final.parent.name / target.name)
            link_target = tmp_path / "outside" / "upper"
        if where == "namespace":
            base = tmp_path / "outside" / "ns" / final.parent.parent.name / final.parent.name
            base.mkdir(parents=True)
            os.link(target, base / target.name)
            link_target = tmp_path / "outside" / "ns"
        if level.exists():
            shutil.rmtree(level) if level.is_dir() else os.unlink(level)
        level.parent.mkdir(parents=True, exist_ok=True)
        level.symlink_to(link_target)
        assert final.exists()  # through the link the block is there ...
        content, atime = snapshot(target)
        before = sorted(str(p) for p in (tmp_path / "outside").rglob("*"))

        loaded = rig.load([key], [GEOMETRY])
        failed = {i: str(f) for i, f in loaded.result.failed.items()}
        assert failed == {0: f"open: {ELOOP}"} and not loaded.delivered  # ... but never read
        assert not loaded.result.failed[0].corrupt  # a link is not a corrupt block: nothing to quarantine

        neighbour = key[:2] + key_of(5, salt="x")[2:]  # same shard directories as ``key``
        assert rig.path(neighbour).parent == final.parent
        stored = rig.store([key, neighbour], [GEOMETRY, GEOMETRY])
        if where == "block":  # the link holds the final name: ours is dropped (EEXIST), the neighbour lands
            assert stored.result.ok and stored.result.published == 1 and final.is_symlink()
            assert not rig.tree.contains(NS.id, key)  # and a lookup never takes the link for a block
        else:
            assert set(stored.result.failed) == {0, 1} and stored.result.published == 0
            assert all(ELOOP in str(reason) for reason in stored.result.failed.values()), stored.result.failed
            assert all(reason.medium_refuses_stores for reason in stored.result.failed.values())
    assert sorted(str(p) for p in (tmp_path / "outside").rglob("*")) == before  # nothing written outside
    assert intact(target, (content, atime))


def test_gc_and_fsck_never_follow_planted_symlinks(tmp_path):
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    key = key_of(6)
    final = tree.block_path(NS.id, key)
    target = outside_block(tmp_path, "shard", key)  # an old, never accessed block: gc's first victim
    lone = outside_block(tmp_path, "file", key_of(7))
    final.parent.parent.mkdir(parents=True)
    final.parent.symlink_to(target.parent)  # leaf shard dir -> outside
    write_block(tree, NS.id, key_of(8), GEOMETRY, payload_of(key_of(8), GEOMETRY.payload_length))
    planted = tree.block_path(NS.id, key_of(9))
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.symlink_to(lone)  # block name -> outside file
    (tree.root / "aa").symlink_to(target.parent)  # root level
    state = {p: snapshot(p) for p in (target, lone)}

    gc = run_gc(tree, 0, min_age_s=0)
    assert gc.freed_files == 1  # only the one real block
    report = fsck(tree, grace_s=0)
    assert {f.problem.value for f in report.findings} == {"foreign"} and len(report.findings) == 3
    assert all(f.is_symlink for f in report.findings)
    repair(tree, report)
    assert report.clean and fsck(tree, grace_s=0).clean
    assert not os.path.lexists(final.parent) and not os.path.lexists(planted)
    for path, before in state.items():  # targets intact and never read
        assert intact(path, before), path


def test_the_connector_misses_through_a_symlink_and_writes_nothing_outside(tmp_path):
    pytest.importorskip("vllm")
    from reliability.connector_rig import chunk_keys, connector

    c = connector(str(tmp_path / "tree"))
    try:
        keys = chunk_keys(2, salt=3)
        c.store(keys)
        outside = tmp_path / "outside"
        final = c.worker.devices[0].block_path(c.worker.namespace.id, keys[0])
        os.rename(final.parent, outside)  # the shard dir moved out, a link left in its place
        final.parent.symlink_to(outside)
        failed, report = c.load(keys, first_block=20)
        assert failed and report.failed_loads == [keys[0]]
        assert c.worker.counters["load_blocks_failed_disk"] == 1 and c.worker.counters.get("quarantined", 0) == 0
        before = sorted(p.name for p in outside.iterdir())
        neighbour = keys[0][:2] + bytes([7]) + keys[0][3:]  # same shard directories as keys[0]
        c.store([neighbour], first_block=30)
        assert c.worker.counters["store_blocks_failed"] == 1
        assert sorted(p.name for p in outside.iterdir()) == before
    finally:
        c.close()


# -- names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", "..", "../etc", "/etc", "ABCDEF", "0g", "aa/bb", "a b", "00\n", "ff\x00",
                                  "é1", "0x1f", "1f.kv"])
def test_only_lowercase_hex_becomes_a_path(tmp_path, name):
    tree = KVTree.create(tmp_path / "tree")
    with pytest.raises(ValueError, match="lowercase hex"):
        tree.namespace_dir(name)
    with pytest.raises(ValueError, match="lowercase hex"):
        tree.block_path(name, b"\x01")


def test_block_paths_are_hex_of_the_key_whatever_its_bytes(tmp_path):
    tree = KVTree.create(tmp_path / "tree")
    for key in (b"../../etc/passwd", b"\x00" * 20, b"/" * 64, "é".encode()):
        path = tree.block_path(NS.id, key)
        assert path.name == key.hex() + ".kv" and path.parent.parent.parent == tree.root / NS.id
        assert os.path.realpath(path).startswith(str(tree.root.resolve()))


# -- modes ----------------------------------------------------------------------------------------

def modes(root: Path) -> dict[str, int]:
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


@pytest.fixture
def no_umask():
    previous = os.umask(0)  # nothing masked: the modes are pykv's own choice
    yield
    os.umask(previous)


@pytest.mark.parametrize("options, file_mode, dir_mode", [
    (None, 0o600, 0o700), (TreeOptions(file_mode=0o640, dir_mode=0o750), 0o640, 0o750)], ids=["default", "shared"])
def test_everything_the_reactor_and_the_cli_create_has_the_configured_mode(tmp_path, no_umask, options,
                                                                           file_mode, dir_mode):
    root = tmp_path / "tree"
    with Rig(root, options=options) as rig:
        keys = [key_of(i) for i in range(8)]
        assert rig.store(keys, [GEOMETRY] * 8).result.ok
        Path(block_files(root)[0]).write_bytes(b"damaged")  # for fsck --repair's quarantine
    tree = KVTree.open(root, options)
    run_gc(tree, 4 * 16384, min_age_s=0)  # catalog and gc.json
    repair(tree, fsck(tree, grace_s=0))  # quarantine
    inspect_tree(tree)
    found = modes(root)
    assert any(p.startswith(".pykv/quarantine/") for p in found) and ".pykv/catalog.db" in found
    wrong = {p: f"{m:04o}" for p, m in found.items()
             if m != (dir_mode if (root / p).is_dir() else file_mode)}
    assert wrong == {}


@pytest.mark.parametrize("extra, file_mode, dir_mode", [({}, 0o600, 0o700),
                                                        ({"file_mode": "0640", "dir_mode": "0750"}, 0o640, 0o750)],
                         ids=["default", "shared"])
def test_the_connector_creates_files_and_directories_with_the_configured_mode(tmp_path, no_umask, extra,
                                                                              file_mode, dir_mode):
    pytest.importorskip("vllm")
    from reliability.connector_rig import chunk_keys, connector

    c = connector(str(tmp_path / "tree"), **extra)
    try:
        c.store(chunk_keys(4, salt=1))
    finally:
        c.close()
    found = modes(tmp_path / "tree")
    assert len(block_files(tmp_path / "tree")) == 4
    assert stat.S_IMODE(os.stat(tmp_path / "tree").st_mode) == 0o777  # the root is the user's: kept as made
    wrong = {p: f"{m:04o}" for p, m in found.items()
             if m != (dir_mode if (tmp_path / "tree" / p).is_dir() else file_mode)}
    assert wrong == {}


@pytest.mark.parametrize("planted", ["catalog.db", "catalog.db-journal", ".pykv"])
def test_gc_never_lets_sqlite_follow_a_planted_link(tmp_path, planted):
    """SQLite follows symlinks: a link planted as gc's catalog (or its journal, or the state dir)
    would have it rewrite another database of the user running gc. gc scans without it instead."""
    import sqlite3

    victim = tmp_path / "victim" / "important.db"
    victim.parent.mkdir()
    with sqlite3.connect(victim) as db:
        db.execute("CREATE TABLE precious (x)")
        db.execute("INSERT INTO precious VALUES (42)")
    db.close()
    content = victim.read_bytes()
    tree = KVTree.create(tmp_path / "tree")
    tree.ensure_namespace(NS)
    write_block(tree, NS.id, key_of(1), GEOMETRY, payload_of(key_of(1), GEOMETRY.payload_length))
    if planted == ".pykv":
        (tmp_path / "tree" / ".pykv").symlink_to(victim.parent)
    else:
        tree.state_dir.mkdir()
        (tree.state_dir / planted).symlink_to(victim)
    result = CliRunner().invoke(app, ["gc", str(tree.root), "--max-size", "0", "--min-age", "0"])
    assert "freed 1 file (" in result.stdout, result.output
    assert victim.read_bytes() == content and sorted(p.name for p in victim.parent.iterdir()) == ["important.db"]


@pytest.mark.parametrize("kernel_has_openat2", [True, False], ids=["openat2", "fallback-walk"])
def test_opening_without_symlinks_refuses_a_link_at_any_depth(tmp_path, monkeypatch, kernel_has_openat2):
    """``pykv.io.openat2`` (the thread-pool backend's open; io_uring passes the same flags to OPENAT2),
    and its component-by-component walk for kernels without openat2 (before Linux 5.6)."""
    from pykv.io import openat2 as module

    monkeypatch.setattr(module, "_have_openat2", kernel_has_openat2)
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"data")
    (tmp_path / "link-dir").symlink_to(tmp_path / "a")
    (tmp_path / "a" / "link-file").symlink_to(tmp_path / "a" / "b" / "f")
    fd = module.openat2(str(tmp_path / "a" / "b" / "f"), os.O_RDONLY)
    assert os.read(fd, 10) == b"data"
    os.close(fd)
    for path in (tmp_path / "link-dir" / "b" / "f", tmp_path / "a" / "link-file"):
        with pytest.raises(OSError) as info:
            module.openat2(str(path), os.O_RDONLY)
        assert info.value.errno == errno.ELOOP
    with pytest.raises(FileNotFoundError):
        module.openat2(str(tmp_path / "a" / "missing"), os.O_RDONLY)
    fd = module.openat2(str(tmp_path / "a" / "new"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "new").st_mode) & 0o077 == 0
