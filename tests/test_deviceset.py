"""Several devices as one cache: rendezvous placement (stable, balanced, minimal moves), the
tree identity it goes by, the sets that are refused, and a store striped over several roots."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import pytest
import xxhash

from pykv.config import PykvConfig
from pykv.deviceset import DeviceSet, rendezvous_index
from pykv.errors import InputError, NotATreeError, RootError
from pykv.media import StripedMedium
from pykv.media.build import open_store_medium
from pykv.store import BlockStore, EngineShape, open_devices
from pykv.staging import slot_bytes_for
from pykv.tree import MARKER_NAME, KVTree
from tests.test_store import GEOMETRY, NS, Client, payload, submit

KEYS = [hashlib.sha256(i.to_bytes(4, "big")).digest()[:16] for i in range(24_000)]
SEEDS = [xxhash.xxh3_64_intdigest(f"device-{i}".encode()) for i in range(9)]


def placements(seeds):
    return [rendezvous_index(key, seeds) for key in KEYS]


def test_placement_is_balanced_over_eight_devices():
    counts = [0] * 8
    for index in placements(SEEDS[:8]):
        counts[index] += 1
    expected = len(KEYS) / 8
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    assert chi2 < 24.32, counts  # 7 degrees of freedom, p = 0.001


def test_adding_a_device_moves_only_its_share():
    before, after = placements(SEEDS[:8]), placements(SEEDS[:9])
    moved = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    assert all(after[i] == 8 for i in moved)  # every moved key went to the new device, none between old ones
    assert abs(len(moved) / len(KEYS) - 1 / 9) < 0.01


def test_removing_a_device_moves_only_its_keys():
    before = placements(SEEDS[:8])
    after = placements(SEEDS[:3] + SEEDS[4:8])  # device 3 gone
    for was, now in zip(before, after):
        if was != 3:
            assert SEEDS[:8][was] == (SEEDS[:3] + SEEDS[4:8])[now]


def make_roots(tmp_path, count):
    roots = [tmp_path / f"dev{i}" for i in range(count)]
    for root in roots:
        root.mkdir()
    return roots


def test_placement_goes_by_identity_not_by_order_or_path(tmp_path):
    roots = make_roots(tmp_path, 4)
    devices = DeviceSet.create(roots)
    where = {key: devices.tree_of(key).identity for key in KEYS[:2000]}
    assert set(where.values()) == {tree.identity for tree in devices}
    moved = tmp_path / "moved"
    roots[2].rename(moved)  # a device mounted elsewhere, listed in another order
    again = DeviceSet.open([roots[3], moved, roots[0], roots[1]])
    assert {key: again.tree_of(key).identity for key in KEYS[:2000]} == where


def test_identity_comes_from_the_marker(tmp_path):
    tree = KVTree.create(tmp_path / "t")
    data = json.loads((tmp_path / "t" / MARKER_NAME).read_text())
    assert tree.identity == data["tree_id"] and len(tree.identity) == 16
    old = tmp_path / "old"  # a marker written before tree_id existed: the hash of its bytes
    old.mkdir()
    raw = json.dumps({"format_version": data["format_version"], "created_at": 1.0}).encode()
    (old / MARKER_NAME).write_bytes(raw)
    assert KVTree.open(old).identity == xxhash.xxh3_64_hexdigest(raw)
    for bad in ("../../etc", "ABCDEF0123456789", "12"):  # not 16 lowercase hex: hashed, never used as given
        (old / MARKER_NAME).write_text(json.dumps({"format_version": data["format_version"], "tree_id": bad}))
        assert KVTree.open(old).identity != bad


@pytest.mark.parametrize("layout", ["same", "nested", "copied"])
def test_overlapping_or_copied_devices_are_refused(tmp_path, layout):
    a, b = make_roots(tmp_path, 2)
    if layout == "same":
        roots = [a, tmp_path / "dev0" / "." ]
    elif layout == "nested":
        KVTree.create(a)
        (a / "inner").mkdir()
        roots = [a, a / "inner"]
    else:
        KVTree.create(a)
        shutil.copy(a / MARKER_NAME, b / MARKER_NAME)  # a device copied with dd or rsync
        roots = [a, b]
    with pytest.raises(InputError) as refused:
        DeviceSet.create(roots)
    assert "roots[0] and kv_connector_extra_config.roots[1]" in str(refused.value)
    assert ("copies of one tree" if layout == "copied" else "overlap") in str(refused.value)
    assert not (a / "inner" / MARKER_NAME).exists()  # refused before any tree was made


def test_a_missing_device_is_refused_and_nothing_is_created(tmp_path):
    a, b = make_roots(tmp_path, 2)
    gone = tmp_path / "not-mounted"
    with pytest.raises(RootError, match=r"roots\[2\]: .*not-mounted does not exist; create it with `pykv init .*"
                                        r"not-mounted` \(pykv never creates a root: a device that did not mount"):
        DeviceSet.create([a, b, gone])
    assert not gone.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match=r"roots\[1\]: .* is not a directory"):
        DeviceSet.create([a, tmp_path / "file"])
    KVTree.create(a)
    with pytest.raises(NotATreeError, match=r"roots\[1\]: .*not a pykv tree"):
        DeviceSet.open([a, b])  # ``open`` (maintenance) never makes trees


def test_one_missing_root_is_refused_as_a_missing_device_is(tmp_path):
    """One rule for one root and several: the engine never creates a root, so a drive that did
    not mount never becomes an empty directory on the OS disk."""
    for root in (tmp_path / "kv", tmp_path / "no" / "kv"):
        with pytest.raises(RootError, match=r"^kv_connector_extra_config\.root: .*kv does not exist; create it with "
                                            r"`pykv init "):
            open_devices(PykvConfig.from_extra_config({"root": str(root)}))
        with pytest.raises(RootError, match=r"^kv_connector_extra_config\.roots: .*kv does not exist"):
            DeviceSet.create([root])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layout, reason", [("file", "is not a directory$"),
                                            ("under-a-file", r"is not a directory \(a component of its path is a file\)"),
                                            ("loop", r"cannot be reached \(a loop of symbolic links\)"),
                                            ("dangling", "is a symbolic link to nothing")])
def test_a_root_that_is_no_directory_is_refused_in_one_line(tmp_path, layout, reason):
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    root = {"file": tmp_path / "file", "under-a-file": tmp_path / "file" / "kv", "loop": tmp_path / "loop",
            "dangling": tmp_path / "dangling"}[layout]
    good = make_roots(tmp_path, 1)[0]
    for roots, field in (([root], "roots"), ([good, root], r"roots\[1\]")):
        with pytest.raises(RootError, match=rf"^kv_connector_extra_config\.{field}: {root} {reason}"):
            DeviceSet.create(roots)
    assert not (tmp_path / "gone").exists() and list(good.iterdir()) == []


def test_roots_must_be_absolute(tmp_path):
    with pytest.raises(InputError, match=r"^kv_connector_extra_config\.root: expected an absolute path, got 'kv'$"):
        PykvConfig.from_extra_config({"root": "kv"})
    with pytest.raises(InputError, match=r"^kv_connector_extra_config\.roots\[1\]: expected an absolute path, "
                                         r"got '\./b'$"):
        PykvConfig.from_extra_config({"roots": ["/a", "./b"]})


def test_a_set_refuses_a_device_holding_other_files(tmp_path):
    a, b = make_roots(tmp_path, 2)
    (b / "thesis.tex").write_text("the user's file")
    with pytest.raises(NotATreeError, match=r"roots\[1\]: .* holds files"):
        DeviceSet.create([a, b])
    assert not (a / MARKER_NAME).exists() or (b / "thesis.tex").read_text() == "the user's file"


def test_devices_on_one_filesystem_are_named_in_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pykv.deviceset"):
        DeviceSet.create(make_roots(tmp_path, 2))
    assert "same filesystem" in caplog.text


def test_one_root_is_the_posix_medium_and_several_are_striped(tmp_path):
    (tmp_path / "one").mkdir()
    one = open_store_medium(open_devices(PykvConfig.from_extra_config({"root": str(tmp_path / "one")})))
    assert one.name == "posix" and one.lanes == 1
    roots = [str(r) for r in make_roots(tmp_path, 3)]
    devices = open_devices(PykvConfig.from_extra_config({"roots": roots}))
    medium = open_store_medium(devices)
    assert isinstance(medium, StripedMedium) and medium.lanes == 3
    for key in KEYS[:50]:
        location = medium.locate(NS.id, key)
        assert medium.lane(location) == devices.index_of(key)
        assert str(location).startswith(roots[devices.index_of(key)] + os.sep)
    with pytest.raises(ValueError):
        medium.lane(tmp_path / "elsewhere" / "x.kv")


def test_root_and_roots_are_exclusive_and_one_is_required():
    with pytest.raises(InputError, match="not both"):
        PykvConfig.from_extra_config({"root": "/a", "roots": ["/b", "/c"]})
    with pytest.raises(InputError, match="required"):
        PykvConfig.from_extra_config({})
    for bad in ("/a", [], ["/a", ""], ["/a", 3], ["/a"] * 65):
        with pytest.raises(InputError, match=r"kv_connector_extra_config\.roots"):
            PykvConfig.from_extra_config({"roots": bad})


def test_auto_staging_grows_with_the_devices():
    slot = 28 << 20
    one = PykvConfig.from_extra_config({"root": "/a"})
    eight = PykvConfig.from_extra_config({"roots": [f"/d{i}" for i in range(8)]})
    assert one.transient_slots(slot) == 2 * 16  # preloading is off by default: no allowance for it
    preloading = PykvConfig.from_extra_config({"root": "/a", "preload": True})
    assert preloading.transient_slots(slot) == 2 * 16 + (256 << 20) // slot
    assert eight.transient_slots(slot) > 4 * one.transient_slots(slot) or eight.transient_slots(slot) * slot * 4 >= \
        os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") - 4 * slot
    assert PykvConfig.from_extra_config({"roots": ["/a", "/b"], "staging_bytes": "1G"}).transient_slots(slot) == 36
    assert PykvConfig.from_extra_config({"root": "/a"}).to_extra_config()["staging_bytes"] == "auto"


def test_auto_verify_threads_follow_the_devices_within_the_cores(monkeypatch):
    eight = [f"/d{i}" for i in range(8)]
    for cores, devices, threads in ((16, 8, 8), (16, 1, 4), (2, 8, 4), (8, 8, 4), (12, 8, 6), (64, 8, 8),
                                    (None, 8, 4)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        config = PykvConfig.from_extra_config({"roots": eight[:devices]} if devices > 1 else {"root": "/a"})
        assert config.verify_threads is None and config.hashing_threads() == threads, (cores, devices)
        assert config.to_extra_config()["verify_threads"] == "auto"
    given = PykvConfig.from_extra_config({"roots": eight, "verify_threads": "3"})
    assert given.hashing_threads() == 3 and given.to_extra_config()["verify_threads"] == 3
    assert PykvConfig.from_extra_config({"root": "/a", "verify_threads": " AUTO "}).verify_threads is None
    for bad in (0, 65, "many", -1, True, 2.5):
        with pytest.raises(InputError, match=r"verify_threads: expected auto or an integer from 1 to 64"):
            PykvConfig.from_extra_config({"root": "/a", "verify_threads": bad})


def test_a_store_striped_over_three_roots_puts_each_block_on_one_candidate_and_loads_it(tmp_path):
    roots = [str(r) for r in make_roots(tmp_path, 3)]
    config = PykvConfig.from_extra_config({"roots": roots, "io_engine": "threadpool", "io_depth": 2})
    client = Client()
    client.store = s = BlockStore(config, EngineShape(NS, slot_bytes_for(GEOMETRY.payload_length), 6), client)
    keys = KEYS[:24]
    try:
        assert submit(s, client, "store", keys, load=False)
        assert not client.wait("store").failures
        homes = []
        for key in keys:
            held = [i for i, tree in enumerate(s.devices) if os.path.exists(tree.block_path(NS.id, key))]
            assert len(held) == 1 and held[0] in s.devices.candidates(key)
            homes.append(held[0])
        assert all(1 <= homes.count(i) <= 12 for i in range(3)), homes  # 8 each, give or take
        for tree in s.devices:  # the namespace record on every device
            assert (tree.namespace_dir(NS.id) / "namespace.json").is_file()
        submit(s, client, "load", keys, load=True)
        assert not client.wait("load").failures and client.loaded == {k: payload(k) for k in keys}
    finally:
        s.close()


def test_auto_io_engine_over_several_devices_is_what_it_is_on_one(tmp_path):
    """``auto`` is io_uring where it works, however many devices: its completions come back on the
    reactor thread alone, where the thread pool's wake an I/O thread each (docs/benchmarks.md)."""
    from pykv.io.probe import open_backend
    from pykv.staging import StagingPool
    from pykv.store import build_reactor
    roots = [str(r) for r in make_roots(tmp_path, 2)]
    config = PykvConfig.from_extra_config({"roots": roots})
    single = open_backend("auto", 8, directory=roots[0])
    expected = single.name
    single.close()
    reactor = build_reactor(config, StagingPool(slot_bytes_for(GEOMETRY.payload_length), 4),
                            open_devices(config), client=None)
    try:
        assert reactor.backend.name == expected and reactor.medium.lanes == 2
    finally:
        reactor.close()
