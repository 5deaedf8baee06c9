"""Two vLLM engines on two clients of one JuiceFS volume (tests/juicefs_volume.py): one stores, a fresh
engine on the other mount hits, with the output and the KV bytes of the same-path reference.

The engines use what pykv picks on the mount itself (io_uring with O_DIRECT, ``pykv doctor`` says
both work on JuiceFS); the second engine finds the blocks only through the file system.
"""

from __future__ import annotations

import pytest
from juicefs_volume import juicefs_volume, unavailable_reason
from typer.testing import CliRunner

from pykv.commands.app import app

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from reliability.engines import (  # noqa: E402
    IN_PROCESS, REFERENCE_ENGINE, SamePath, finish, gen, ktc, kv_digest, log_errors, reference_steps, settle, snap,
    start, tiny_model_work, tokens)

CHUNK = 256  # tokens per storage block
PROMPT = tokens(61, 790)  # three whole storage blocks; vLLM's own cache hits the same 768 tokens
LOADED_ENGINE_BLOCKS = 3 * CHUNK // 32


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with juicefs_volume(tmp_path_factory.mktemp("juicefs-e2e"), clients=2) as volume:
        yield volume


def run(work, name, ktc_, steps, engine=None) -> dict:
    return finish(*start(work, name, ktc_, steps, engine, IN_PROCESS))


def test_an_engine_on_one_client_hits_what_an_engine_on_another_stored(tmp_path_factory, volume):
    work = tiny_model_work(tmp_path_factory, "juicefs-e2e-work")
    reference = run(work, "reference", None,
                    reference_steps([("P", PROMPT), ("P", PROMPT)]) + [kv_digest("P-kv", "P#0", LOADED_ENGINE_BLOCKS)],
                    REFERENCE_ENGINE)
    same_path = SamePath(reference)
    assert sorted(same_path.by_prompt["P"]) == [0, 3 * CHUNK]

    (volume.mounts[0] / "pykv").mkdir()
    root_a, root_b = volume.mounts[0] / "pykv", volume.mounts[1] / "pykv"
    stored = run(work, "S", ktc(root_a), [gen("s", PROMPT), settle(work, "S"), snap(work, "S", "s1")])
    assert stored["s"][0]["num_cached_tokens"] == 0 and stored["s"][0]["tokens"] == same_path.cold("P")
    assert stored["s1"]["worker0"]["store_published"] == 3

    hit = run(work, "H", ktc(root_b), [gen("h", PROMPT), kv_digest("h-kv", "h", LOADED_ENGINE_BLOCKS),
                                       settle(work, "H"), snap(work, "H", "h1")])
    assert hit["h"][0]["num_cached_tokens"] == 3 * CHUNK
    assert hit["h"][0]["tokens"] == same_path.at("P", 3 * CHUNK)
    assert hit["h-kv"] == reference["P-kv"]  # the loaded blocks hold the bytes the cold prefill computed
    assert hit["h1"]["worker0"]["load_blocks_disk"] == 3
    assert hit["h1"]["worker0"].get("load_blocks_failed_disk", 0) == 0
    assert log_errors(work, "S") == [] and log_errors(work, "H") == []
    for root in (root_a, root_b):
        result = CliRunner().invoke(app, ["fsck", str(root)])
        assert result.exit_code == 0, result.output
