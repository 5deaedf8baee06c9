#!/usr/bin/env python3
"""H200 benchmark of pykv in stock vLLM: TTFT and load bandwidth against recompute
and vLLM's native CPU and fs offload tiers, on the host's virtio disk and on a
loop device in /dev/shm (an emulated fast NVMe).

Method (as the anchors in shared/device/anchors/ttft_probe.py): one engine per
process, Llama-3.2-3B shape with dummy weights, enforce_eager,
max_num_batched_tokens=8192, GPU prefix caching off, 256-token offload blocks,
max_tokens=1, one warm-up request per engine, PYTHONHASHSEED=0, documents of
random tokens seeded by (length, doc) so fill and query engines see the same
prompts, every result a JSON line.

    h200_connector.py stage A|B|C|D|all|A,B,...   run stages (see `plan`)
    h200_connector.py plan [--stages all]          print what each stage does
    h200_connector.py report FILE...               tables, target ratios, markdown
    h200_connector.py sources FILE...              pykv hits per source that ran (before/after)
    h200_connector.py engine CONFIG.json           (internal) one engine process
    h200_connector.py bw ...                       (internal) O_DIRECT / H2D probes
    h200_connector.py mbw ...                      (internal) O_DIRECT of several devices at once

Stages (each fits in one 10-minute device command; benchmarks/h200_run.sh STAGE):
  A  O_DIRECT (virtio) and pinned H2D bandwidth; recompute; native CPU tier
  B  pykv on the virtio disk: fill engine, page cache dropped, fresh engine:
     disk hit then DRAM hit per document; again with verify="full"
  C  pykv on a loop device in /dev/shm: O_DIRECT bandwidth, then as B
  D  vLLM's native fs tier (TieringOffloadingSpec) on a loop device: fill
     engine, page cache dropped, fresh engine query
  M  DRAM hits side by side: native CPU tier, then pykv with a DRAM tier (one
     engine: fill, then two DRAM-served queries per document)
  L  loop device bandwidth sweep: request sizes, depths, split reactor reads
  K  `pykv calibrate` (library call) for --cal-shape on --cal-medium, with the
     gated sweep
  S1 8 loop devices as one pykv cache: aggregate O_DIRECT of 1 and 8 devices,
     pykv disk hits with `pykv config`'s defaults on 8 devices and on 1
  S2 native fs tier on device 0 per --fs-threads setting; the 1-device control again
  S3 `pykv calibrate` over the 8 devices, with the gated sweep
  T1 tensor parallelism --tp (2), 8B shape: recompute (and vLLM's prefix-cache oracle), pykv
     fill, a TP=1 probe over the TP=2 tree, fresh TP=2 query engine (disk hits, greedy tokens)
  T2 vLLM's native fs tier at TP=2: fill, page cache dropped, fresh query engine (T: T1 then T2)

pykv's load bandwidth is bytes / seconds of the request's load jobs (submission
to the reactor until the last byte is on the GPU), as the worker counts them
(load_job_bytes, load_job_us in its PYKV_STATS_FILE counter file); the engines
run the stock PykvSpec. The code is in the h200bench package beside this script.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
