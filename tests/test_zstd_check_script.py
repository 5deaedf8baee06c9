"""``benchmarks/h200_zstd_check.py`` runs (its ``--cpu`` path) with the options the next lease
uses (a 64 KiB chunk, the start check as under a MAC): every block loads byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
REPO = Path(__file__).resolve().parents[1]


def test_loads_are_exact_with_a_64_kib_chunk_as_under_a_mac(tmp_path):
    out = tmp_path / "check.jsonl"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "h200_zstd_check.py"), "--cpu", "--chunks", "2",
                           "--threads", "2", "--chunk-kib", "64", "--authenticated", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["scatter"] for r in records] == [False, True]
    for record in records:
        assert "error" not in record, record
        assert record["codec_params"].endswith("chunk=65536") and record["authenticated"]
        assert record["failed"] == [] and record["wrong_pages"] == 0 and record["load_gbps"] > 0
