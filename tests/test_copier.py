"""Slice copies between KV tensors and slots, one per run of consecutive block ids."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from pykv.connector.copier import contiguous_runs  # noqa: E402


@pytest.mark.parametrize("ids, runs", [
    ([], []),
    ([7], [(0, 7, 1)]),
    ([3, 4, 5, 6], [(0, 3, 4)]),
    ([3, 4, 9, 10, 11, 2], [(0, 3, 2), (2, 9, 3), (5, 2, 1)]),
    ([5, 4, 3], [(0, 5, 1), (1, 4, 1), (2, 3, 1)]),
])
def test_contiguous_runs(ids, runs):
    assert contiguous_runs(np.array(ids, dtype=np.int64)) == runs


def test_runs_cover_every_id_once():
    rng = np.random.default_rng(0)
    ids = rng.permutation(64)[:40]
    covered = [first + k for _, first, count in contiguous_runs(ids) for k in range(count)]
    assert covered == list(ids)
