"""``benchmarks/h200_zstd_steps.py`` runs (its ``--cpu`` smoke path) and its three plane merges
rebuild the source KV exactly, so the GPU lease spends its time on figures, not on a broken script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_part_is_timed_and_every_merge_rebuilds_the_kv(tmp_path):
    out = tmp_path / "steps.jsonl"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "h200_zstd_steps.py"), "--cpu", "--blocks", "2",
                           "--chunk-kib", "1024,256", "--steps", "1,2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["chunk"], r["step_blocks"]) for r in records] == [(1 << 20, 1), (1 << 20, 2), (1 << 18, 1), (1 << 18, 2)]
    for record in records:
        assert "error" not in record, record
        assert record["wrong_blocks"] == {"merge_transposed_host": 0, "merge_strided": 0, "merge_arithmetic": 0}
        assert record["frames"] == 2 * 28 * (1 << 20) // record["chunk"]  # the exponent plane of each chunk
        assert record["raw_planes"] == record["frames"]  # the mantissa plane of each chunk: stored raw
        assert 0.6 < record["ratio"] < 0.75
        for part in ("h2d_all_stored", "zero_rows", "decode_host", "raw_planes_gather", "merge_transposed_host",
                     "merge_strided", "merge_arithmetic"):
            assert record[f"{part}_gbps_of_kv"] > 0
