"""Stages S1, S2, S3 (issue 17): pykv over several loop devices in the tmpfs, against one device and
vLLM's native fs tier, in one lease.

S1: the device set (``--stripe-devices``, 8); aggregate O_DIRECT reads of 1 and N devices at once
    (``multibw``; and ``pykv bench`` over the N paths where the command runs); pykv with what
    ``pykv config --root ... `` prints over the N devices: fill engine, page cache dropped, fresh
    query engine (disk hits, DRAM tier 0; ``--stripe-queries`` queries per document); again with one
    root on device 0 (the control).
S2: vLLM's native fs tier on device 0: fill engine, then per ``--fs-threads`` setting page cache
    dropped and a fresh query engine (and the first setting again when time allows); then, when
    time allows, S1's one-device pykv control again (the report pools both runs).
S3: ``pykv calibrate`` over the N devices (the library call of stage K, ``--cal-*`` options) with
    the gated sweep.

The devices (``stripe0`` ...) outlive a stage: the next command of the lease reuses the ones still
mounted (``LoopDevices.ensure``) and a stage removes them only with ``--stripe-cleanup``. Images are
sparse, so only what is written takes memory; devices are mounted with ``discard`` and trees are
removed (and trimmed) when a part is done, so the tmpfs gives the memory back between parts.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
from pathlib import Path

from h200bench import calibrate_stage, interfaces
from h200bench.loop import image_bytes
from h200bench.runner import ENTRY
from h200bench.settings import CHUNK, GIB, WARMUP_TOKENS
from h200bench.util import count_files, drop_caches, log, tree_bytes

DEVICE_PREFIX = "stripe"
TREES = ("pykv-stripe", "kvfs", "cal", "bw")
S3_REPEAT = 3
"""Stage S3's runs per length and path: a median of three sets an engine's slow first sample at a
length aside, for every path alike (with two, one such sample moved a length's ratio past 5 %)."""
"""Directories the stages make on a device (``pykv-stripe{N}``, the native tier's, the calibration's,
the probes'): the only ones they remove."""


def medium(count: int) -> str:
    return f"stripe{count}"


# -- the device set -----------------------------------------------------------------------------------
def image_size(runner) -> int:
    """Each device's (sparse) image: room for the whole tree of the documents, since device 0 alone
    holds it in the one-device control and for the native fs tier."""
    if runner.a.stripe_image_gib:
        return int(runner.a.stripe_image_gib * GIB)
    return image_bytes(tree_bytes(runner.lengths, runner.loop_docs, runner.info()["kv_bytes_per_token"]))


def devices(runner) -> list[str]:
    """The mount points of the set: those still mounted from an earlier command of the lease, the
    others made fresh."""
    if runner.smoke and not runner.a.smoke_loop:
        raise RuntimeError("stages S1-S3 need loop devices (--smoke-loop to try them with --cpu-smoke)")
    size = image_size(runner)
    if not runner.dry:
        runner.loops.clean_shm()
    mnts = [runner.loops.ensure(f"{DEVICE_PREFIX}{i}", size, stage=runner.stage)
            for i in range(runner.a.stripe_devices)]
    runner.record({"kind": "env", "stage": runner.stage, "what": "stripe_set", "mounts": mnts, "image_bytes": size})
    return mnts


def clear(runner, mnts: list[str]) -> None:
    """Remove what the stages left on the devices (only their own directories) and trim."""
    if runner.dry:
        return
    for mnt in mnts:
        for entry in Path(mnt).iterdir():
            if entry.is_dir() and entry.name.startswith(TREES):
                shutil.rmtree(entry, ignore_errors=True)
        runner.loops.trim(mnt)


def finish(runner, mnts: list[str]) -> None:
    """End of a stage: the devices stay for the next command unless ``--stripe-cleanup``."""
    if runner.dry:
        print(f"  devices: {'torn down' if runner.a.stripe_cleanup else 'kept for the next command'}")
        return
    if runner.a.keep_trees:
        log("trees kept (--keep-trees)")
    else:
        clear(runner, mnts)
    if runner.a.stripe_cleanup:
        runner.loops.teardown_all(prefix=DEVICE_PREFIX)


# -- parts ----------------------------------------------------------------------------------------------
def aggregate_bandwidth(runner, mnts: list[str]) -> None:
    """O_DIRECT reads of 1 and N devices at once (``multibw``), then ``pykv bench`` over the N paths."""
    dirs = [os.path.join(m, "bw") for m in mnts]
    if not runner.dry:
        from pykv.bench import fio_available
        runner.record({"kind": "env", "stage": runner.stage, "what": "fio", "available": fio_available()})
    argv = [sys.executable, str(ENTRY), "mbw", "--results", str(runner.results), "--stage", runner.stage,
            "--dirs", ",".join(dirs), "--counts", f"1,{len(dirs)}" if len(dirs) > 1 else "1",
            "--size", str(int(runner.a.mbw_gib * GIB)), "--repeat", str(runner.a.mbw_repeat)]
    if runner.smoke:
        argv += ["--size", str(64 << 20), "--repeat", "1", "--files-size", str(56 << 20),
                 "--copy-threads", "1,2", "--copy-bytes", str(32 << 20)]
    if runner.dry:
        print(f"  mbw: host memory copy with 1/4/8/16 threads; {len(dirs)} devices, {runner.a.mbw_gib:g} GiB each, "
              "4 MiB x 16 and 28 MiB x 8 per device; then the reactor over 1 GiB of block files per device "
              "(verify header and full)")
    else:
        runner.spawn("mbw", argv, 240)
    interfaces.pykv_bench(runner, dirs, medium=medium(len(dirs)))
    clear(runner, mnts)


def pykv_disk_hits(runner, mnts: list[str], again: str = "", *, variant: str = "defaults",
                   extra: dict | None = None, queries: list[tuple[str, dict]] | None = None) -> None:
    """pykv with ``pykv config``'s defaults over ``mnts``: fill, page cache dropped, fresh query engine
    (labels ending in ``again`` when the same measurement is repeated: the report pools both).
    ``extra``: keys added to the defaults, under another ``variant``. ``queries``: (variant, keys)
    of several query engines after the one fill, each with its keys added (load-side keys only:
    ``verify``, ``verify_threads``, ``io_engine``), the page cache dropped before each."""
    name = medium(len(mnts))
    roots = [os.path.join(m, f"pykv-{name}") for m in mnts]
    if not runner.dry:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
    ktc = interfaces.pykv_config(runner, roots, medium=name)
    ktc["kv_connector_extra_config"].update(extra or {})
    tags = dict(system="pykv", medium=name, variant=variant, ktc=ktc, stats=True, docs=runner.loop_docs)
    label = name if variant == "defaults" else f"{name}-{variant}"
    fill = runner.engine(f"pykv-{label}-fill{again}", steps=[{"op": "fill"}, {"op": "settle", "timeout": 300}], **tags)
    if fill != 0:
        log(f"pykv {label}: fill failed; query skipped")
        return
    if not runner.dry:
        files = [count_files(root, ".kv") for root in roots]
        runner.record({"kind": "tree", "stage": runner.stage, "medium": name, "variant": variant, "roots": roots,
                       "files": sum(files),
                       "files_per_device": files,
                       "bytes_expected": tree_bytes(runner.lengths, runner.loop_docs,
                                                    runner.info()["kv_bytes_per_token"])})
    phases = ["query"] * max(1, runner.a.stripe_queries)
    for query_variant, keys in queries or [(variant, {})]:
        if not runner.dry:
            runner.record({"kind": "drop_caches", "stage": runner.stage, "ok": drop_caches()})
        query_ktc = copy.deepcopy(ktc)
        query_ktc["kv_connector_extra_config"].update(keys)
        query_label = label if query_variant == variant else f"{name}-{query_variant}"
        runner.engine(f"pykv-{query_label}-query{again}", steps=[{"op": "query", "phases": phases}],
                      **{**tags, "variant": query_variant, "ktc": query_ktc})
    if not runner.dry and not runner.a.keep_trees:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
        for mnt in mnts:
            runner.loops.trim(mnt)


def native_fs(runner, mnt: str) -> None:
    """vLLM's native fs tier on one device: one fill engine (16 threads, as stage D), then a fresh query engine per thread
    setting (page cache dropped before each), then the first setting again while time allows."""
    root = os.path.join(mnt, "kvfs")
    threads = [int(t) for t in runner.a.fs_threads.split(",")]
    name = medium(1)
    if not runner.dry:
        shutil.rmtree(root, ignore_errors=True)
        runner.loops.ensure_shm(int(runner.fs_cpu_gib() * GIB))
    expected = sum(length // CHUNK for length in runner.lengths) * runner.loop_docs + WARMUP_TOKENS // CHUNK
    fill = runner.engine(f"native-fs-{name}-fill", system="native_fs", medium=name, variant="fill",
                         steps=[{"op": "fill"}, {"op": "settle", "files_root": root, "files_expected": expected,
                                                 "timeout": 240}],
                         ktc=runner.native_ktc(root), docs=runner.loop_docs)
    if fill != 0:
        log("native fs: fill failed; queries skipped")
        return
    if not runner.dry:
        runner.record({"kind": "tree", "stage": runner.stage, "medium": name, "root": root, "system": "native_fs",
                       "files": count_files(root, ".bin"), "files_expected": expected})
    plan = [(t, f"threads{t}") for t in threads] + [(threads[0], f"threads{threads[0]}-again")]
    for i, (t, variant) in enumerate(plan):
        optional = i == len(plan) - 1
        if not runner.dry and runner.remaining() < (runner.a.optional_min_s if optional else 75):
            log(f"native fs {variant}: skipped ({runner.remaining():.0f} s left)")
            runner.record({"kind": "skipped", "stage": runner.stage, "label": f"native-fs-{name}-{variant}",
                           "why": "time"})
            continue
        if not runner.dry:
            runner.record({"kind": "drop_caches", "stage": runner.stage, "ok": drop_caches()})
        runner.engine(f"native-fs-{name}-{variant}", system="native_fs", medium=name, variant=variant,
                      steps=[{"op": "query", "phases": ["query"]}], ktc=runner.native_ktc(root, t),
                      docs=runner.loop_docs)


def calibrate(runner, mnts: list[str]) -> None:
    """``pykv calibrate`` over the devices with pykv's defaults (and ``--pykv-set`` keys), gated sweep."""
    a = runner.a
    CalibrationRun, _ = calibrate_stage.calibrate_job()
    roots = [Path(m) / "cal" for m in mnts]
    if not runner.dry:
        for root in roots:
            root.mkdir(exist_ok=True)
    settings = dict(item.partition("=")[::2] for item in interfaces.set_items(runner))
    repeat = a.cal_repeat or S3_REPEAT
    if runner.dry:
        print(f"  calibrate 3b over {len(roots)} roots ({roots[0]} ...): lengths {a.cal_lengths}, tiers "
              f"{a.cal_tiers}, repeat {repeat}, gate check {not a.no_cal_gate}, settings {settings or 'defaults'}")
        return
    run = interfaces.calibration_over(
        CalibrationRun, roots, model=runner.model, lengths=[int(x) for x in a.cal_lengths.split(",")],
        tiers=a.cal_tiers.split(","), repeat=repeat, block_tokens=CHUNK, settings=settings,
        engine_args=calibrate_stage.engine_args(runner), bandwidth_bytes=(64 << 20) if runner.smoke else 2 * GIB,
        check_gate=not a.no_cal_gate, dram_bytes=(64 << 20) if runner.smoke else None)
    calibrate_stage.calibrate_and_record(runner, run, shape="3b", medium=medium(len(mnts)), where=",".join(
        str(r) for r in roots))


# -- stages -----------------------------------------------------------------------------------------------
def stripe_variants(items: list[str], *, option: str = "--stripe-variant",
                    empty: bool = False) -> list[tuple[str, dict]]:
    """``--stripe-variant NAME:KEY=VALUE[;KEY=VALUE]`` items as (variant, keys); a value of digits
    is an int (vLLM's ``block_size`` must be one). ``empty``: an item may add no keys."""
    variants = []
    for item in items:
        name, _, pairs = item.partition(":")
        keys = dict(pair.split("=", 1) for pair in pairs.split(";") if "=" in pair)
        if not name.strip() or not (keys or empty):
            raise SystemExit(f"{option} {item!r}: expected NAME:KEY=VALUE[;KEY=VALUE]")
        variants.append((name.strip(), {k.strip(): int(v) if v.strip().isdigit() else v.strip()
                                        for k, v in keys.items()}))
    return variants


def stage_s1(runner) -> None:
    runner.phase_env()
    mnts = devices(runner)
    variants = stripe_variants(runner.a.stripe_variant or [])
    queries = stripe_variants(runner.a.stripe_query or [], option="--stripe-query", empty=True)
    try:
        clear(runner, mnts)
        if variants:  # only the disk hits of each variant (issue 38's codecs)
            for variant, keys in variants:
                pykv_disk_hits(runner, mnts, variant=variant, extra=keys,
                               queries=[(variant + name, query) for name, query in queries] or None)
            return
        aggregate_bandwidth(runner, mnts)
        pykv_disk_hits(runner, mnts)
        if len(mnts) > 1:
            if not runner.dry and runner.remaining() < 150:
                log(f"pykv on one device: skipped ({runner.remaining():.0f} s left)")
                runner.record({"kind": "skipped", "stage": runner.stage, "label": "pykv-stripe1", "why": "time"})
            else:
                pykv_disk_hits(runner, mnts[:1])
    finally:
        finish(runner, mnts)


def stage_s2(runner) -> None:
    if runner.smoke:
        log("stage S2: skipped in --cpu-smoke (vLLM's fs tier refuses the CPU platform)")
        return
    mnts = devices(runner)
    try:
        clear(runner, mnts[:1])
        native_fs(runner, mnts[0])
        if runner.dry or runner.remaining() >= runner.a.optional_min_s + 20:
            clear(runner, mnts[:1])  # the native tree: both do not fit one image
            pykv_disk_hits(runner, mnts[:1], again="-again")  # the control again, beside the native engines
        else:
            log(f"pykv on one device again: skipped ({runner.remaining():.0f} s left)")
            runner.record({"kind": "skipped", "stage": runner.stage, "label": "pykv-stripe1-again", "why": "time"})
    finally:
        finish(runner, mnts)


def stage_s3(runner) -> None:
    mnts = devices(runner)
    try:
        clear(runner, mnts)
        calibrate(runner, mnts)
    finally:
        finish(runner, mnts)
