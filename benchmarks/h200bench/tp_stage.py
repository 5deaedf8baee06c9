"""Stage T (issue 19): pykv with tensor parallelism (``--tp``, 2) on the ``--tp-shape`` (8B) model,
dummy weights, one document per length (``--loop-docs``) on a loop device in the tmpfs.

T1: recompute TTFT (no connector; vLLM's prefix cache on, so the same engine serves the oracle
    document twice: its second, prefix-cache-hit output is what a pykv hit of the same length must
    produce); pykv fill engine; a TP=1 probe engine over the TP=N tree (must load nothing; it stores
    one document of its own, in its own namespace); page cache dropped; a fresh TP=N query engine:
    disk hits, the oracle document (greedy tokens) and the TP=1-only document (must miss). The tree's
    block files are counted per namespace (TP size, rank); every record keeps the workers'
    counters per rank.
T2: vLLM's native fs tier at TP=N on its own loop device: fill engine, page cache dropped, fresh
    query engine (skipped with ``--cpu-smoke``: the fs tier refuses the CPU platform).
T:  T1, then T2.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from h200bench import calibrate_stage
from h200bench.loop import image_bytes
from h200bench.settings import CHUNK, GIB, SHAPE_KV_BYTES_PER_TOKEN, WARMUP_TOKENS
from h200bench.util import count_files, drop_caches, log, tree_bytes

ORACLE_DOC = 0
"""The oracle document: the first length plus one token, so that a pykv hit (whole storage blocks)
and a prefix-cache hit (whole engine blocks) cover the same tokens."""
TP1_ONLY_DOC = 900
"""A document of the first length that only the TP=1 probe stores."""
ORACLE_MAX_TOKENS = 8


def medium(tp: int) -> str:
    return f"tp{tp}"


def model_dir(runner) -> str:
    """``--model-dir`` when given (the smoke's tiny model), else the ``--tp-shape`` model in WORK."""
    if runner.a.model_dir:
        return runner.model
    return calibrate_stage.shape_model(runner, runner.a.tp_shape)


@contextmanager
def engines(runner, tp: int) -> Iterator[None]:
    """The runner's engines on the stage's model with ``tensor_parallel_size`` ``tp``, restored after."""
    saved = runner.model, runner.tp
    runner.model, runner.tp = model_dir(runner), tp
    try:
        yield
    finally:
        runner.model, runner.tp = saved


def kv_per_token(runner) -> int:
    """KV bytes per token of the stage's model (of the shape, in a dry run that wrote no config)."""
    if runner.dry and not (Path(runner.model) / "config.json").exists():
        return SHAPE_KV_BYTES_PER_TOKEN[runner.a.tp_shape]
    return runner.info()["kv_bytes_per_token"]


def oracle_length(runner) -> int:
    return min(runner.lengths) + 1


def tokens_step(runner, phase: str, *, repeat: int = 1, doc: int = ORACLE_DOC, max_tokens: int = ORACLE_MAX_TOKENS,
                length: int | None = None) -> dict:
    return {"op": "tokens", "length": length or oracle_length(runner), "doc": doc, "max_tokens": max_tokens,
            "repeat": repeat, "phase": phase}


def namespaces(root: str) -> list[dict]:
    """Block files per namespace directory of a pykv tree: ``tp_size``, ``tp_rank``, ``files``."""
    found = []
    for directory in sorted(Path(root).iterdir()) if os.path.isdir(root) else []:
        meta = directory / "namespace.json"
        if meta.is_file():
            ns = json.loads(meta.read_text())
            found.append({"namespace": directory.name, "tp_size": ns.get("tp_size"), "tp_rank": ns.get("tp_rank"),
                          "files": count_files(str(directory), ".kv")})
    return found


def pykv_tree_bytes(runner, kv_per_token: int) -> int:
    """Bytes of the TP=N fill with the oracle document (every rank's file has its own header) and of
    the TP=1 probe's stores (the first length's documents, its own one and the warm-up)."""
    first, warm = min(runner.lengths), WARMUP_TOKENS // CHUNK
    blocks = sum(length // CHUNK for length in runner.lengths) * runner.loop_docs + warm \
        + oracle_length(runner) // CHUNK
    tp1_blocks = (first // CHUNK) * (runner.loop_docs + 1) + warm
    return blocks * (CHUNK * kv_per_token + 8192 * runner.tp) + tp1_blocks * (CHUNK * kv_per_token + 8192)


def place(runner, name: str, tree: int, extra_shm: int = 0) -> tuple[str, bool]:
    """Where a stage part's tree goes: a fresh loop device (its mount point, True), or with
    ``--cpu-smoke`` (no ``--smoke-loop``) a directory in WORK (False)."""
    if runner.smoke and not runner.a.smoke_loop:
        base = str(runner.work / f"tp-{name}")
        if not runner.dry:
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(base)
        return base, False
    return runner.loop_setup(f"tp-{name}", image_bytes(tree), extra_shm=extra_shm), True


def record_tree(runner, root: str, when: str) -> None:
    if not runner.dry:
        runner.record({"kind": "tp_tree", "stage": runner.stage, "medium": medium(runner.a.tp), "root": root,
                       "when": when, "namespaces": namespaces(root)})


def stage_t1(runner) -> None:
    tp = runner.a.tp
    name = medium(tp)
    with engines(runner, tp):
        runner.phase_env()
        kv = kv_per_token(runner)
        if runner.dry:
            print(f"  model {runner.model} (shape {runner.a.tp_shape}), tensor_parallel_size {tp}; oracle document "
                  f"{oracle_length(runner)} tokens, {ORACLE_MAX_TOKENS} greedy tokens")
        base, loop = place(runner, "pykv", pykv_tree_bytes(runner, kv))
        root = os.path.join(base, "pykv-tree")
        try:
            runner.engine(f"{name}-recompute", system="recompute", medium=name, variant="prefix-cache",
                          steps=[{"op": "query", "phases": ["query"]}, tokens_step(runner, "oracle", repeat=2)],
                          ktc=None, docs=runner.loop_docs, engine_kw={"enable_prefix_caching": True})
            tags = dict(system="pykv", medium=name, stats=True, docs=runner.loop_docs)
            fill = runner.engine(f"{name}-pykv-fill", variant="header",
                                 steps=[{"op": "fill"}, tokens_step(runner, "fill"), {"op": "settle", "timeout": 300}],
                                 ktc=runner.pykv_ktc(root, dram_bytes=0, verify="header"), **tags)
            if fill != 0:
                log(f"pykv TP={tp}: fill failed; queries skipped")
                return
            record_tree(runner, root, "fill")
            probe = tp1_probe(runner, root)
            if not runner.dry:
                runner.record({"kind": "drop_caches", "stage": runner.stage, "ok": drop_caches()})
            steps = [{"op": "query", "phases": ["query"]}, tokens_step(runner, "hit")]
            if probe == 0:  # the TP=1 probe stored a document of its own: a TP=N engine must not read it
                steps.append(tokens_step(runner, "tp1-only", doc=TP1_ONLY_DOC, max_tokens=1,
                                         length=min(runner.lengths)))
            runner.engine(f"{name}-pykv-query", variant="header", steps=steps,
                          ktc=runner.pykv_ktc(root, dram_bytes=0, verify="header"), **tags)
            record_tree(runner, root, "end")
        finally:
            if not runner.dry and not runner.a.keep_trees:
                shutil.rmtree(root, ignore_errors=True)
            if loop and not runner.dry:
                runner.loops.teardown_all()


def tp1_probe(runner, root: str) -> int | None:
    """A TP=1 engine over the TP=N tree: the first length's documents (must load nothing), then a
    document of its own that it stores (in the TP=1 namespace). None when skipped for time."""
    label = f"{medium(runner.a.tp)}-pykv-tp1-probe"
    if not runner.dry and runner.remaining() < runner.a.optional_min_s + runner.reserve + 60:
        log(f"{label}: skipped ({runner.remaining():.0f} s left)")
        runner.record({"kind": "skipped", "stage": runner.stage, "label": label, "why": "time"})
        return None
    runner.tp = 1
    try:
        first = min(runner.lengths)
        rc = runner.engine(label, system="pykv", medium=medium(runner.a.tp), variant="tp1-over-tp2", stats=True,
                           steps=[{"op": "query", "phases": ["query"]},
                                  tokens_step(runner, "tp1-store", doc=TP1_ONLY_DOC, max_tokens=1, length=first),
                                  {"op": "settle", "timeout": 120}],
                           ktc=runner.pykv_ktc(root, dram_bytes=0, verify="header"), docs=runner.loop_docs,
                           lengths=[first])
    finally:
        runner.tp = runner.a.tp
    record_tree(runner, root, "tp1-probe")
    return rc


def stage_t2(runner) -> None:
    tp = runner.a.tp
    name = medium(tp)
    if runner.smoke:
        log("stage T2: native fs tier skipped in --cpu-smoke (vLLM's fs tier refuses the CPU platform)")
        return
    with engines(runner, tp):
        size = tree_bytes(runner.lengths, runner.loop_docs, kv_per_token(runner))
        mnt, _ = place(runner, "fs", size, extra_shm=int(runner.fs_cpu_gib() * GIB))
        root = os.path.join(mnt, "kvfs")
        expected = sum(length // CHUNK for length in runner.lengths) * runner.loop_docs + WARMUP_TOKENS // CHUNK
        tags = dict(system="native_fs", medium=name, variant="threads16", ktc=runner.native_ktc(root),
                    docs=runner.loop_docs)
        try:
            fill = runner.engine(f"{name}-native-fs-fill", steps=[
                {"op": "fill"}, {"op": "settle", "files_root": root, "files_expected": expected, "timeout": 240}],
                **tags)
            if fill != 0:
                log(f"native fs TP={tp}: fill failed; query skipped")
                return
            if not runner.dry:
                runner.record({"kind": "tree", "stage": runner.stage, "medium": name, "root": root,
                               "system": "native_fs", "files": count_files(root, ".bin"),
                               "files_expected": expected})
                runner.record({"kind": "drop_caches", "stage": runner.stage, "ok": drop_caches()})
            runner.engine(f"{name}-native-fs-query", steps=[{"op": "query", "phases": ["query"]}], **tags)
        finally:
            if not runner.dry:
                runner.loops.teardown_all()


def stage_t(runner) -> None:
    stage_t1(runner)
    if not runner.dry and runner.remaining() < 200:
        log(f"stage T: T2 skipped ({runner.remaining():.0f} s left; run it as its own command)")
        runner.record({"kind": "skipped", "stage": runner.stage, "label": f"{medium(runner.a.tp)}-native-fs",
                       "why": "time"})
        return
    stage_t2(runner)
