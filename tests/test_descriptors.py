"""Pointer lists for batched copies: applied with memmove they move exactly what TorchCopier moves."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from pykv.connector.copier import CopyTask, TorchCopier  # noqa: E402
from pykv.connector.descriptors import copy_descriptors  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402

BPC = 4  # GPU blocks per storage block
NUM_BLOCKS = 24


def _kv_tensors(seed: int) -> list[torch.Tensor]:
    """Three byte tensors as vLLM hands them over: packed rows, padded rows, rows of a wider buffer."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-128, 127, (NUM_BLOCKS, 64), dtype=torch.int8, generator=g)
    padded = torch.randint(-128, 127, (NUM_BLOCKS, 48), dtype=torch.int8, generator=g)  # page 40 of 48 bytes
    wide = torch.randint(-128, 127, (NUM_BLOCKS, 96), dtype=torch.int8, generator=g)[:, 16:48]  # stride 96
    return [packed, padded, wide]


LAYOUT = BlockLayout(BPC, 64, (
    (RefPage(0, 64), RefPage(1, 40)),  # group 0: two refs, one padded
    (RefPage(2, 32),),                 # group 1: a strided view
))


def _payload(group: int, seed: int) -> torch.Tensor:
    size = sum(r.page_bytes for r in LAYOUT.groups[group]) * BPC
    return torch.randint(-128, 127, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


def _apply(entries) -> None:
    for src, dst, size in zip(entries.src, entries.dst, entries.sizes):
        ctypes.memmove(int(dst), int(src), int(size))


CASES = [
    (0, [3, 4, 5, 6], 0),      # one run
    (0, [9, 2, 3, 17], 0),     # broken runs
    (0, [11, 12], 2),          # partial first chunk (skip 2)
    (1, [5, 6, 7, 1], 0),      # strided tensor: one entry per page
    (1, [20], 3),
]


@pytest.mark.parametrize("group, ids, skip", CASES)
def test_loads_match_torch_copies(group, ids, skip):
    expected, actual = _kv_tensors(1), _kv_tensors(1)
    payload = _payload(group, 2)
    ids = np.array(ids, dtype=np.int64)
    TorchCopier(expected, LAYOUT).from_slots([CopyTask(payload, group, ids, skip)], lambda t, ok: None)
    _apply(copy_descriptors([CopyTask(payload, group, ids, skip)], actual, LAYOUT, to_slot=False))
    for e, a in zip(expected, actual):
        assert torch.equal(e, a)
    assert not torch.equal(_kv_tensors(1)[LAYOUT.groups[group][0].tensor], actual[LAYOUT.groups[group][0].tensor])


@pytest.mark.parametrize("group, ids", [(0, [3, 4, 5, 6]), (0, [8, 1, 2, 15]), (1, [0, 1, 2, 3])])
def test_stores_match_torch_copies(group, ids):
    kv = _kv_tensors(3)
    ids = np.array(ids, dtype=np.int64)
    expected, actual = torch.zeros_like(_payload(group, 0)), torch.zeros_like(_payload(group, 0))
    TorchCopier(kv, LAYOUT).to_slots([CopyTask(expected, group, ids, 0)], lambda t, ok: None)
    _apply(copy_descriptors([CopyTask(actual, group, ids, 0)], kv, LAYOUT, to_slot=True))
    assert torch.equal(expected, actual)
    assert expected.abs().sum() > 0


def test_a_batch_of_tasks_is_one_list():
    kv = _kv_tensors(4)
    tasks = [CopyTask(_payload(0, 5), 0, np.array([1, 2, 3, 4]), 0), CopyTask(_payload(1, 6), 1, np.array([7, 9]), 2)]
    entries = copy_descriptors(tasks, kv, LAYOUT, to_slot=False)
    # group 0: packed ref = 1 run, padded ref = 4 pages; group 1 strided: 2 pages
    assert len(entries) == 1 + 4 + 2
    assert entries.total_bytes == 4 * (64 + 40) + 2 * 32
    assert entries.src.dtype == entries.dst.dtype == entries.sizes.dtype == np.int64


def test_empty_batch():
    entries = copy_descriptors([], _kv_tensors(0), LAYOUT, to_slot=False)
    assert len(entries) == 0 and entries.total_bytes == 0


def test_runs_never_span_two_tasks():
    """Ids that continue from one chunk into the next live in different slots: two entries."""
    before, after = _kv_tensors(7), _kv_tensors(7)
    tasks = [CopyTask(_payload(0, 8), 0, np.array([4, 5, 6, 7]), 0), CopyTask(_payload(0, 9), 0, np.array([8, 9]), 2)]
    TorchCopier(before, LAYOUT).from_slots(tasks, lambda t, ok: None)
    entries = copy_descriptors(tasks, after, LAYOUT, to_slot=False)
    _apply(entries)
    for e, a in zip(before, after):
        assert torch.equal(e, a)
    assert len(entries) == 2 + 6  # packed ref: one run per task; padded ref: one entry per page
