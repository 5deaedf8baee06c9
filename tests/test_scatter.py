"""Loads through the device scratch (``connector/scatter.py``): the same bytes as straight copies for
any order of GPU block ids, on CPU tensors; CudaCopier's use of it with CUDA's calls faked."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from pykv.connector.copier import CopyTask, CudaCopier, TorchCopier  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402
from pykv.connector.scatter import ScatterLoads, id_runs, worth_scattering  # noqa: E402
from pykv.connector import copier as copier_module  # noqa: E402
from test_cuda_copier_threads import FakeCuda, _memmove_op, load_all  # noqa: E402

BPC = 4
NUM_BLOCKS = 40


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream and event calls stood in by fakes (as in test_cuda_copier_threads)."""
    fake = FakeCuda()
    monkeypatch.setattr(copier_module.torch, "cuda", fake)
    return fake
ONE_GROUP = BlockLayout(BPC, 64, ((RefPage(0, 64), RefPage(1, 40)),))
TWO_GROUPS = BlockLayout(BPC, 64, ((RefPage(0, 64), RefPage(1, 40)), (RefPage(2, 24),)))


def kv_tensors(seed: int = 1) -> list[torch.Tensor]:
    """Three KV tensors of int8 rows: packed 64-byte pages, 40-byte pages in 48-byte rows, 24 packed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (NUM_BLOCKS, width), dtype=torch.int8, generator=g) for width in (64, 48, 24)]


def tasks_for(layout: BlockLayout, id_lists: list[tuple[int, list[int], int]], seed: int = 2) -> list[CopyTask]:
    """(group, GPU block ids, skip) -> tasks with random payloads of the group's size."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group, ids, skip in id_lists:
        size = layout.geometry(group).payload_length
        out.append(CopyTask(torch.randint(-128, 127, (size,), dtype=torch.int8, generator=g), group,
                            np.array(ids, dtype=np.int64), skip))
    return out


def straight(layout: BlockLayout, tasks: list[CopyTask], seed: int = 1) -> list[torch.Tensor]:
    expected = kv_tensors(seed)
    TorchCopier(expected, layout).from_slots(tasks, lambda t, ok: None)
    return expected


ORDERS = {
    "descending": [(0, [39, 38, 37, 36], 0), (0, [35, 34, 33, 32], 0), (0, [31, 30, 29, 28], 0)],
    "mixed": [(0, [3, 9, 4, 5], 0), (0, [20, 21, 22, 23], 0), (0, [12, 11], 2), (0, [0, 30, 15], 1)],
    "ascending": [(0, [0, 1, 2, 3], 0), (0, [4, 5, 6, 7], 0)],
}


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("slots", [1, 2, 8])
def test_the_scratch_moves_the_same_bytes_as_straight_copies(order, slots):
    tasks = tasks_for(ONE_GROUP, ORDERS[order])
    tensors = kv_tensors()
    keep = ScatterLoads(tensors, ONE_GROUP, slots=slots).issue(tasks)
    assert keep
    for got, want in zip(tensors, straight(ONE_GROUP, tasks)):
        assert torch.equal(got, want)  # every row loaded right, every other row (and padding) untouched


def test_two_groups_and_a_task_with_nothing_to_load():
    spec = [(0, [9, 8, 7, 6], 0), (1, [19, 18, 17], 1), (1, [], 0), (0, [1, 0], 2)]
    tasks = tasks_for(TWO_GROUPS, spec)
    tensors = kv_tensors()
    ScatterLoads(tensors, TWO_GROUPS, slots=2).issue(tasks)
    for got, want in zip(tensors, straight(TWO_GROUPS, tasks)):
        assert torch.equal(got, want)


def test_only_out_of_order_batches_are_worth_the_scratch():
    assert id_runs(tasks_for(ONE_GROUP, ORDERS["descending"])) == 12
    assert worth_scattering(tasks_for(ONE_GROUP, ORDERS["descending"]))
    assert not worth_scattering(tasks_for(ONE_GROUP, ORDERS["ascending"]))  # one run per task
    assert not worth_scattering(tasks_for(ONE_GROUP, [(0, [4, 5, 6, 7], 0), (0, [3, 2], 2)]))  # 3 runs, 2 tasks
    assert not worth_scattering([])


@pytest.mark.parametrize("batched", [False, True])
def test_the_cuda_copier_sends_out_of_order_loads_through_the_scratch(fake_cuda, batched):
    tasks = tasks_for(ONE_GROUP, ORDERS["descending"] + [(0, [11, 10, 9, 8], 0)])  # 16 runs over 4 tasks
    tensors = kv_tensors()
    copier = CudaCopier(tensors, ONE_GROUP, streams=1, batched=False, scatter_slots=3)
    if batched:
        copier._batch_op = _memmove_op  # the bulk copies as pointer lists, as vLLM's op takes them
    assert load_all(copier, tasks) == [True] * len(tasks)
    assert copier.stats["h2d_scatter_batches"] == 1 and copier.stats["h2d_entries"] == len(tasks)
    for got, want in zip(tensors, straight(ONE_GROUP, tasks)):
        assert torch.equal(got, want)


def test_ascending_loads_are_copied_straight_and_no_scratch_is_made(fake_cuda):
    tasks = tasks_for(ONE_GROUP, ORDERS["ascending"])
    tensors = kv_tensors()
    copier = CudaCopier(tensors, ONE_GROUP, streams=1, batched=False, scatter_slots=3)
    assert load_all(copier, tasks) == [True] * len(tasks)
    assert "h2d_scatter_batches" not in copier.stats and copier._scatter._scratch is None
    for got, want in zip(tensors, straight(ONE_GROUP, tasks)):
        assert torch.equal(got, want)


def test_no_device_memory_for_the_scratch_copies_straight_from_then_on(fake_cuda, monkeypatch, caplog):
    tasks = tasks_for(ONE_GROUP, ORDERS["descending"])
    tensors = kv_tensors()
    copier = CudaCopier(tensors, ONE_GROUP, streams=1, batched=False, scatter_slots=3)

    def out_of_memory() -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(copier._scatter, "scratch", out_of_memory)
    assert load_all(copier, tasks) == [True] * len(tasks)
    assert copier._scatter is None and "no device memory for 3 scatter slots" in caplog.text
    for got, want in zip(tensors, straight(ONE_GROUP, tasks)):
        assert torch.equal(got, want)
