"""``scatter_rows`` (pykv/connector/scatter.py) writes exactly what the plain copier writes from
the same payloads: every page of every row into its KV block, nothing else; for whole chunks and
partial ones (a skip, fewer ids), descending and scattered ids, several groups in one step, rows
wider than the page, and pages whose sizes or offsets are not whole 8-byte words; and one
``RowScatter`` reused over many steps (its kept views) writes what a fresh one writes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pykv.connector.copier import CopyTask, TorchCopier  # noqa: E402
from pykv.connector.layout import BlockLayout, RefPage  # noqa: E402
from pykv.connector.scatter import RowScatter, scatter_rows  # noqa: E402

NUM_BLOCKS = 40


def kv_tensors(widths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 128, (NUM_BLOCKS, w), dtype=torch.int8, generator=generator) for w in widths]


def payload_rows(count, raw, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (count * raw,), dtype=torch.int8, generator=generator)


def expected(tensors, layout, payload, raw, tasks):
    """The plain copier's result of copying row i into tasks[i]'s blocks, task by task."""
    out = [t.clone() for t in tensors]
    copier = TorchCopier(out, layout)
    ends = []
    for i, task in enumerate(tasks):
        copier.from_slots([CopyTask(payload[i * raw:(i + 1) * raw], task.group, task.gpu_ids, task.skip)],
                          lambda t, ok: ends.append(ok))
    assert ends == [True] * len(tasks), "the reference copy failed"
    return out


def check(layout, widths, tasks, raw):
    tensors = kv_tensors(widths)
    payload = payload_rows(len(tasks), raw)
    want = expected(tensors, layout, payload, raw, tasks)
    got = [t.clone() for t in tensors]
    scatter_rows(got, layout, payload, raw, tasks)
    for index, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"KV tensor {index} differs"
    if any(len(t.gpu_ids) for t in tasks):
        assert any(not torch.equal(a, b) for a, b in zip(got, tensors)), "nothing was written"
    return got, tensors


def task(ids, skip=0, group=0):
    return CopyTask(torch.zeros(0, dtype=torch.int8), group, np.asarray(ids, dtype=np.int64), skip)


PAGE = 64
LAYOUT = BlockLayout(4, 64, ((RefPage(0, PAGE), RefPage(1, PAGE), RefPage(2, PAGE)),))
RAW = 3 * 4 * PAGE


def test_whole_chunks_in_any_order():
    tasks = [task([0, 1, 2, 3]), task([11, 10, 9, 8]), task([30, 5, 22, 17])]
    got, before = check(LAYOUT, [PAGE] * 3, tasks, RAW)
    untouched = sorted(set(range(NUM_BLOCKS)) - {0, 1, 2, 3, 8, 9, 10, 11, 30, 5, 22, 17})
    for a, b in zip(got, before):
        assert torch.equal(a[untouched], b[untouched]), "a block outside the tasks changed"


def test_partial_chunks_skip_and_short():
    tasks = [task([7, 6], skip=2), task([12, 13, 14]), task([20], skip=1), task([1, 2, 3, 4])]
    check(LAYOUT, [PAGE] * 3, tasks, RAW)


def test_empty_task_writes_nothing():
    tasks = [task([]), task([5, 4, 3, 2])]
    check(LAYOUT, [PAGE] * 3, tasks, RAW)


def test_rows_wider_than_the_page():
    layout = BlockLayout(2, 32, ((RefPage(0, 48), RefPage(1, 48)),))
    check(layout, [64, 80], [task([3, 9]), task([10, 2])], 2 * 2 * 48)


def test_pages_not_whole_words():
    layout = BlockLayout(3, 48, ((RefPage(0, 6), RefPage(1, 10)),))
    raw = 3 * 6 + 3 * 10
    check(layout, [6, 10], [task([0, 5, 9]), task([8, 7], skip=1)], raw)


def test_two_groups_in_one_step():
    layout = BlockLayout(2, 32, ((RefPage(0, 16),), (RefPage(1, 16),)))
    tasks = [task([1, 2], group=0), task([5, 4], group=1), task([9], skip=1, group=0)]
    check(layout, [16, 16], tasks, 2 * 16)


def test_matches_random_layouts():
    rng = np.random.default_rng(38)
    for _ in range(25):
        bpc = int(rng.integers(1, 6))
        pages = [int(p) for p in rng.choice([2, 8, 24, 64], size=int(rng.integers(1, 4)))]
        widths = [p + int(rng.choice([0, 0, 8, 3])) for p in pages]
        layout = BlockLayout(bpc, 16 * bpc, (tuple(RefPage(i, p) for i, p in enumerate(pages)),))
        raw = sum(pages) * bpc
        free = list(rng.permutation(NUM_BLOCKS))
        tasks = []
        for _ in range(int(rng.integers(1, 5))):
            skip = int(rng.integers(0, bpc)) if rng.random() < 0.3 else 0
            count = bpc - skip if rng.random() < 0.7 else int(rng.integers(0, bpc - skip + 1))
            tasks.append(task([free.pop() for _ in range(count)], skip=skip))
        check(layout, widths, tasks, raw)


@pytest.mark.parametrize("ids,skip", [([0, 1, 2, NUM_BLOCKS], 0), ([-1, 1, 2, 3], 0), ([1, 2, 3], 2)])
def test_ids_outside_the_kv_or_a_chunk_overrun_raise_before_writing(ids, skip):
    tensors = kv_tensors([PAGE] * 3)
    before = [t.clone() for t in tensors]
    tasks = [task([20, 21, 22, 23]), task(ids, skip=skip)]
    with pytest.raises(IndexError):
        scatter_rows(tensors, LAYOUT, payload_rows(2, RAW), RAW, tasks)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before)), "a block was written before the refusal"


def test_fp8_kv_tensors_move_as_bits():
    """KV tensors of another dtype (an fp8 cache's bytes) are written bit for bit, never converted."""
    tensors = [t.view(torch.float8_e4m3fn) for t in kv_tensors([PAGE] * 3)]
    payload = payload_rows(1, RAW)
    scatter_rows(tensors, LAYOUT, payload, RAW, [task([9, 3, 4, 5])])
    want = expected([t.view(torch.int8) for t in kv_tensors([PAGE] * 3)], LAYOUT, payload, RAW, [task([9, 3, 4, 5])])
    assert all(torch.equal(a.view(torch.int8), b) for a, b in zip(tensors, want))


def test_one_row_scatter_over_many_steps_matches_fresh_ones():
    """The views a RowScatter keeps (by rows, row length, group) stay right as the scratch's
    contents, the step's shape and whole/partial chunks change from step to step."""
    layout = BlockLayout(2, 32, ((RefPage(0, 16), RefPage(1, 24)), (RefPage(2, 8),)))
    raws = {0: 2 * (16 + 24), 1: 2 * 8}
    tensors = kv_tensors([16, 24, 8])
    scratch = torch.zeros(4 * raws[0], dtype=torch.int8)
    kept = RowScatter(tensors, layout, scratch)
    rng = np.random.default_rng(5)
    for step in range(40):
        group = int(rng.integers(0, 2))
        raw = raws[group]
        count = int(rng.integers(1, 5))
        free = list(rng.permutation(NUM_BLOCKS))
        tasks = []
        for _ in range(count):
            skip = int(rng.integers(0, 2)) if rng.random() < 0.3 else 0
            tasks.append(task([free.pop() for _ in range(2 - skip)], skip=skip, group=group))
        scratch[:count * raw] = payload_rows(count, raw, seed=step)
        want = expected(tensors, layout, scratch[:count * raw].clone(), raw, tasks)
        kept.rows(raw, tasks)
        assert all(torch.equal(a, b) for a, b in zip(tensors, want)), f"step {step} differs"
