"""Two rendezvous candidates per block: a store's blocks even over the devices, lookups on both."""

from __future__ import annotations

import hashlib
from collections import Counter

from pykv.deviceset import DeviceSet
from pykv.store import open_store_medium
from pykv.tree import KVTree

NS = "00c0ffee"
KEYS = [hashlib.sha256(b"choices" + i.to_bytes(4, "big")).digest()[:16] for i in range(4_000)]


def striped(tmp_path, count, names=None):
    names = names or [f"dev{i}" for i in range(count)]
    trees = []
    for name in names:
        (tmp_path / name).mkdir(exist_ok=True)
        trees.append(KVTree.create(tmp_path / name))
    devices = DeviceSet(trees)
    return devices, open_store_medium(devices)


def publish(path):
    """A regular file at a block's name: what ``contains`` looks for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


def lanes(medium, locations):
    return [medium.lane(location) for location in locations]


def test_an_80k_store_is_even_over_eight_devices(tmp_path):
    devices, medium = striped(tmp_path, 8)
    keys = KEYS[:320]  # an 80k-token request of 256-token blocks
    placed = lanes(medium, medium.place(NS, keys))
    counts = Counter(placed)
    assert all(lane in devices.candidates(key) for key, lane in zip(keys, placed))
    assert len(counts) == 8 and max(counts.values()) <= 45, counts  # mean 40; one choice: ~50, up to ~60


def test_a_request_stored_in_steps_is_even_too(tmp_path):
    devices, medium = striped(tmp_path, 8)
    placed = []
    for first in range(0, 320, 32):  # one store job per prefill step of 8k tokens
        placed += lanes(medium, medium.place(NS, KEYS[first:first + 32]))
    assert max(Counter(placed).values()) <= 45, Counter(placed)


def test_lookups_find_a_block_on_either_candidate(tmp_path):
    devices, medium = striped(tmp_path, 4)
    key = KEYS[0]
    first, second = devices.candidates(key)
    assert not medium.contains(NS, key)
    assert medium.lane(medium.locate(NS, key)) == first  # nowhere: looked for on the first choice
    on_second = devices[second].block_path(NS, key)
    publish(on_second)
    assert medium.contains(NS, key) and medium.locate(NS, key) == on_second
    assert devices.holder(NS, key) is devices[second]
    other = KEYS[1]
    off = next(i for i in range(4) if i not in devices.candidates(other))
    publish(devices[off].block_path(NS, other))
    assert not medium.contains(NS, other) and devices.holder(NS, other) is None  # off its candidates: a miss


def test_a_block_already_stored_keeps_its_place(tmp_path):
    devices, medium = striped(tmp_path, 4)
    keys = KEYS[:64]
    stored = {}
    for key in keys:  # every block already on its second choice
        stored[key] = devices[devices.candidates(key)[1]].block_path(NS, key)
        publish(stored[key])
    assert medium.place(NS, keys) == [stored[key] for key in keys]  # no second copy anywhere


def test_adding_a_device_loses_about_its_share(tmp_path):
    devices, medium = striped(tmp_path, 8)
    keys = KEYS[:4000]
    homes = [devices[lane].identity for lane in lanes(medium, medium.place(NS, keys))]
    grown, _ = striped(tmp_path, 9, [f"dev{i}" for i in range(9)])  # the same 8 trees and one more
    index = {tree.identity: i for i, tree in enumerate(grown)}
    lost = sum(index[home] not in grown.candidates(key) for key, home in zip(keys, homes)) / len(keys)
    assert 0.06 <= lost <= 0.17, lost  # about 1/9


def test_one_device_has_one_candidate(tmp_path):
    devices, medium = striped(tmp_path, 1)
    assert devices.candidates(KEYS[0]) == (0,)
    assert medium.place(NS, KEYS[:3]) == [medium.locate(NS, key) for key in KEYS[:3]]


def test_the_balance_benchmark_prints_both_columns():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "placement_balance.py"
    out = subprocess.run([sys.executable, str(script), "--devices", "4", "--trials", "3", "--lengths", "8192"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = [line for line in out.stdout.splitlines() if line.strip().startswith("8,192")]
    assert len(row) == 1 and row[0].count("%") == 4
