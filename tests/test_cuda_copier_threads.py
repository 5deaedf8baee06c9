"""CudaCopier's copy thread on CPU tensors, CUDA's stream and event calls stood in by fakes.

``from_slots`` and ``to_slots`` only queue; the copier's thread issues what is queued (the loads
as one batch), and every task's ``done`` is called exactly once, with the bytes in place when it
says ok.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from pykv.connector import copier as copier_module  # noqa: E402
from pykv.connector.copier import CopyTask, CudaCopier, TorchCopier  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402

BPC = 4
NUM_BLOCKS = 32
LAYOUT = BlockLayout(BPC, 64, ((RefPage(0, 64), RefPage(1, 40)),))


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        assert self.recorded

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 0.5


class FakeStream:
    def __init__(self, device=None) -> None:
        self.device = device

    def wait_event(self, event) -> None:
        return

    def wait_stream(self, stream) -> None:
        return


class FakeCuda:
    """The torch.cuda names CudaCopier calls."""

    Event = FakeEvent
    Stream = FakeStream

    def __init__(self) -> None:
        self.devices_set: list = []

    def current_stream(self, device=None) -> FakeStream:
        return FakeStream(device)

    def set_device(self, device) -> None:
        self.devices_set.append(device)

    @staticmethod
    @contextlib.contextmanager
    def stream(stream):
        yield


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(copier_module.torch, "cuda", fake)
    return fake


def _kv() -> list[torch.Tensor]:
    return [torch.zeros(NUM_BLOCKS, 64, dtype=torch.int8), torch.zeros(NUM_BLOCKS, 48, dtype=torch.int8)]


def _tasks(count: int) -> list[CopyTask]:
    size = (64 + 40) * BPC
    g = torch.Generator().manual_seed(3)
    return [CopyTask(torch.randint(-128, 127, (size,), dtype=torch.int8, generator=g), 0,
                     np.arange(i * BPC, (i + 1) * BPC, dtype=np.int64), 0) for i in range(count)]


def _memmove_op(src, dst, sizes, *, is_src_access_order_any: bool) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(int(d), int(s), int(n))


def load_all(copier: CudaCopier, tasks: list[CopyTask]) -> list[bool]:
    """``tasks`` as one ``from_slots`` call; each task's ``ok``, in the order they ended (the copier
    closed afterwards)."""
    ended: list[bool] = []
    all_done = threading.Event()

    def done(task: CopyTask, ok: bool) -> None:
        ended.append(ok)
        if len(ended) == len(tasks):
            all_done.set()
    try:
        copier.from_slots(tasks, done)
        assert all_done.wait(10)
    finally:
        copier.close()
    return ended


@pytest.mark.parametrize("batched", [False, True])
def test_queued_batches_go_out_and_each_task_ends_once(fake_cuda, batched):
    tensors, expected = _kv(), _kv()
    tasks = _tasks(NUM_BLOCKS // BPC)
    TorchCopier(expected, LAYOUT).from_slots(tasks, lambda t, ok: None)
    copier = CudaCopier(tensors, LAYOUT, streams=2, batched=False)
    if batched:
        copier._batch_op = _memmove_op
    ended: list[tuple[int, bool]] = []
    all_done = threading.Event()

    def done(task: CopyTask, ok: bool) -> None:
        ended.append((id(task), ok))
        if len(ended) == len(tasks):
            all_done.set()

    try:
        for i in range(0, len(tasks), 3):  # three from_slots calls, as the reactor's deliveries come
            copier.from_slots(tasks[i:i + 3], done)
        assert all_done.wait(10)
    finally:
        copier.close()
    assert sorted(ended) == sorted((id(t), True) for t in tasks)
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    assert 1 <= copier.stats["h2d_batches"] <= 3
    assert fake_cuda.devices_set == [tensors[0].device]


def test_a_failed_issue_fails_every_task_of_the_batch(fake_cuda):
    copier = CudaCopier(_kv(), LAYOUT, streams=1, batched=False)

    def broken(*args, **kwargs):
        raise RuntimeError("cuMemcpyBatchAsync failed")

    copier._batch_op = broken
    assert load_all(copier, _tasks(2)) == [False, False]


def test_close_issues_what_was_queued(fake_cuda):
    tensors = _kv()
    copier = CudaCopier(tensors, LAYOUT, streams=1, batched=False)
    tasks = _tasks(4)
    ended: list[bool] = []
    copier.from_slots(tasks, lambda task, ok: ended.append(ok))
    copier.close()
    assert ended == [True] * 4


def test_stores_queued_beside_loads_copy_the_kv_into_their_slots(fake_cuda):
    tensors = _kv()
    generator = torch.Generator().manual_seed(5)
    for t in tensors:
        t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8, generator=generator))
    loads, stores = _tasks(2), _tasks(6)[2:]  # loads into blocks 0-7, stores read blocks 8-23
    for task in stores:
        task.payload.zero_()
    expected = [torch.empty_like(t.payload) for t in stores]
    reference = TorchCopier([t.clone() for t in tensors], LAYOUT)
    for task, out in zip(stores, expected):
        reference.to_slots([CopyTask(out, task.group, task.gpu_ids, task.skip)], lambda t, ok: None)
    copier = CudaCopier(tensors, LAYOUT, streams=3, batched=False)
    ended: list[tuple[str, bool]] = []
    all_done = threading.Event()

    def done_as(kind):
        def done(task: CopyTask, ok: bool) -> None:
            ended.append((kind, ok))
            if len(ended) == len(loads) + len(stores):
                all_done.set()
        return done

    try:
        copier.to_slots(stores[:2], done_as("store"))
        copier.from_slots(loads, done_as("load"))
        copier.to_slots(stores[2:], done_as("store"))
        assert all_done.wait(10)
    finally:
        copier.close()
    assert sorted(ended) == [("load", True)] * 2 + [("store", True)] * 4
    assert all(torch.equal(task.payload, out) for task, out in zip(stores, expected))
    assert fake_cuda.devices_set == [tensors[0].device]


def test_the_copy_check_script_checks_loads_and_stores(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "h200_copy_check.py"
    out = tmp_path / "copy_check.jsonl"
    run = subprocess.run([sys.executable, str(script), "--chunks", "2", "--rounds", "1", "--batch", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = {r["what"] for r in records}
    assert {"copier_load", "copier_store"} <= kinds
    assert all(r["wrong_blocks"] == 0 for r in records if "wrong_blocks" in r)


def test_a_thread_that_cannot_select_the_device_still_ends_every_copy(fake_cuda, monkeypatch, caplog):
    import logging

    def refuse(device):
        raise RuntimeError("invalid device ordinal")

    monkeypatch.setattr(fake_cuda, "set_device", refuse)
    copier = CudaCopier(_kv(), LAYOUT, streams=1, batched=False)
    ended: list[bool] = []
    all_done = threading.Event()

    def done(task: CopyTask, ok: bool) -> None:
        ended.append(ok)
        if len(ended) == 3:
            all_done.set()

    with caplog.at_level(logging.ERROR, logger="pykv.connector.copier"):
        try:
            copier.from_slots(_tasks(3), done)
            assert all_done.wait(10)
        finally:
            copier.close()
    assert len(ended) == 3
    assert any("could not select" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["torch", "cuda-torch", "cuda-batched"])
def test_copy_ranges_moves_exactly_the_ranges(fake_cuda, kind):
    """``copy_ranges``: every (source, at, target, to, length) row lands where it says, from
    several sources into two targets, nothing else written; the batched op gets one call."""
    g = torch.Generator().manual_seed(9)
    sources = [torch.randint(-128, 127, (n,), dtype=torch.int8, generator=g) for n in (300, 50, 1000)]
    targets = (torch.zeros(700, dtype=torch.uint8), torch.zeros(400, dtype=torch.uint8))
    ranges = np.array([(0, 10, 0, 0, 100), (2, 999, 0, 100, 1), (1, 0, 1, 7, 50), (2, 3, 1, 300, 97),
                       (0, 200, 0, 600, 100)], dtype=np.int64)
    want = [t.clone() for t in targets]
    for s, at, t, to, n in ranges.tolist():
        want[t][to:to + n] = sources[s].view(torch.uint8)[at:at + n]
    calls = []
    if kind == "torch":
        copier = TorchCopier(_kv(), LAYOUT)
    else:
        copier = CudaCopier(_kv(), LAYOUT, streams=1, batched=False)
        if kind == "cuda-batched":
            copier._batch_op = lambda *args, **kw: (calls.append(len(args[0])), _memmove_op(*args, **kw))
    try:
        kept = copier.copy_ranges(sources, targets, ranges, source_in_order=False)
    finally:
        copier.close()
    assert all(torch.equal(a, b) for a, b in zip(targets, want))
    assert calls == ([5] if kind == "cuda-batched" else [])
    assert (kept is not None) == (kind == "cuda-batched")  # the pointer tensors, kept by the caller
