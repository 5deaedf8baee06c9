"""``PykvManager`` + ``PykvWorker`` on CPU tensors without an engine (needs vLLM and torch importable).

The same round trip vLLM drives, in-process and in milliseconds: the reliability
tests use it for what the connector itself does (quarantine, store pauses, modes,
symlinks) and keep real engines for the end-to-end claims.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from pykv.connector.compat import CanonicalKVCaches, GPULoadStoreSpec, OffloadingConfig, ReqContext
from pykv.config import PykvConfig
from pykv.connector.manager import PykvManager
from pykv.connector.worker import PykvWorker
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

LAYERS, BLOCKS, PAGE, BPC, TOKENS = 2, 64, 4096, 4, 16


def offloading_config(root: str, *, tp_size: int = 1, rank: int = 0, dtype: str = "bfloat16",
                      blocks_per_chunk: int = BPC, tokens: int = TOKENS, page: int = PAGE, model: str = "tiny",
                      **extra) -> OffloadingConfig:
    os.makedirs(root, exist_ok=True)  # the tree's directory, as `pykv init` makes it: engines never create a root
    group = OffloadingGroupConfig(tokens_per_block=tokens, layer_names=tuple(f"l{i}" for i in range(LAYERS)),
                                  group_id=0)
    parallel = OffloadingParallelConfig(rank=rank, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1,
                                        dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                        data_parallel_rank_local=None, is_parallelism_agnostic=False)
    return OffloadingConfig(groups=(group,), worker_kv_bytes_per_block=LAYERS * page, enable_kv_cache_events=False,
                            extra_config={"root": root, "staging_bytes": "1M", **extra}, engine_id="e",
                            model=OffloadingModelConfig(name=model, dtype=dtype),
                            cache=OffloadingCacheConfig(tokens_per_hash=tokens, blocks_per_chunk=blocks_per_chunk),
                            parallel=parallel, kv_cache_layout="LBHNC")


@dataclass
class Connector:
    manager: PykvManager
    worker: PykvWorker
    kv: list[torch.Tensor]
    ctx: ReqContext
    _job: int = 0

    def store(self, keys: list[bytes], first_block: int = 0) -> tuple[set[int], object]:
        """Store ``len(keys)`` chunks from GPU blocks ``first_block`` on; (failed block ids, report)."""
        out = self.manager.prepare_store(keys, self.ctx)
        n = len(out.keys_to_store) * self.worker.layout.blocks_per_chunk
        self._job += 1
        self.worker.submit_store(self._job, GPULoadStoreSpec(list(range(first_block, first_block + n)), [n], [0]),
                                 out.store_spec)
        result = self.finish(self._job)
        self.manager.on_worker_report(result[1])
        self.manager.complete_store(out.keys_to_store, self.ctx)
        return result

    def load(self, keys: list[bytes], first_block: int) -> tuple[set[int], object]:
        spec = self.manager.prepare_load(keys, self.ctx)
        n = len(keys) * self.worker.layout.blocks_per_chunk
        self._job += 1
        self.worker.submit_load(self._job, spec, GPULoadStoreSpec(list(range(first_block, first_block + n)), [n], [0]))
        result = self.finish(self._job)
        self.manager.on_worker_report(result[1])
        self.manager.complete_load(keys, self.ctx)
        return result

    def finish(self, job: int, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.worker.get_finished()
            if done:
                assert [r.job_id for r in done] == [job] and done[0].success
                return self.worker.get_block_ids_with_load_errors(), self.worker.take_report()
            time.sleep(0.005)
        raise TimeoutError(job)

    def close(self) -> None:
        self.worker.shutdown()


def connector(root: str, **extra) -> Connector:
    """A manager and a worker on ``root`` with random KV in every block."""
    config = offloading_config(root, **extra)
    pykv = PykvConfig.from_extra_config(config.extra_config)
    tensors = [CanonicalKVCacheTensor(torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8,
                                                    generator=torch.Generator().manual_seed(t)), PAGE)
               for t in range(LAYERS)]
    caches = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
    return Connector(PykvManager(config, pykv), PykvWorker(config, pykv, caches), [t.tensor for t in tensors],
                     ReqContext("r"))


def chunk_keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 16 + (0).to_bytes(4, "big") for i in range(n)]
