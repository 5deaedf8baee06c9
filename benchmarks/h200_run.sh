#!/usr/bin/env bash
# benchmarks/h200_run.sh STAGE [options of `h200_connector.py stage`]
#
# Runs one stage of the pykv H200 benchmark on the GPU host, from the repository
# root (the device tool's working directory). STAGE: A, B, C, D, L, K, M, S1-S5, T1, T2, T, LM, P40, P80, R, I, a comma
# list (C,D), all (A-M), report, or setup (install and import check only). See
# benchmarks/README.md for the device commands.
#
# - installs vLLM 0.26 from the carried parts when $SITE/vllm is missing
#   (shared/device/install.sh, run from $PARTS/part2);
# - copies pykv/ (the installed package's layout; an older snapshot's top-level
#   connector/, jobs/ and commands/ go under it) to $WORK/shim, adds xxhash from
#   .device/extra when the image lacks it;
# - stage LM installs LMCache from .device/lmcache into $WORK/lmcache-site itself (once per lease;
#   h200bench/lmcache_stage.py), for its engines only;
# - runs the stage with a deadline (PYKV_H200_BUDGET_S, default 560 s after this
#   script started: the device tool stops a command at 600 s);
# - appends JSON lines to $WORK/results.jsonl (persistent on the held host) and
#   copies it, the report and the engine logs to $OUT (what comes back).
#
# Host paths (environment; defaults in brackets): PYKV_H200_WORK [/tmp/pykv-h200],
# PYKV_H200_SITE, where vLLM is installed [/tmp/site], PYKV_H200_PARTS, where the
# device commands put the carried parts [/tmp/pykv-device], PYKV_SRC, the pykv
# sources to run [the working tree]. Every JSON line carries `source` (PYKV_H200_SOURCE
# [PYKV_SRC's folder name, or worktree]), `source_digest` (of the .py files run), `source_commit`
# (a snapshot's COMMIT file, h200_snapshot.sh) and `source_run` (PYKV_H200_RUN_ID [STAGE-starttime]). The stage's own paths are options of
# `h200_connector.py stage` (--disk-dir, --shm, --mount-base; benchmarks/README.md).
set -uo pipefail
T0=$(date +%s)
STAGE=${1:?usage: bash benchmarks/h200_run.sh STAGE (A|B|C|D|L|K|M|S1|S2|S3|S4|S5|T1|T2|T|LM|P40|P80|R|I|C,D|all|report|setup) [stage options]}
shift
REPO=$(pwd)
WORK=${PYKV_H200_WORK:-/tmp/pykv-h200}
OUTDIR=${OUT:-$WORK/out}
BUDGET=${PYKV_H200_BUDGET_S:-560}
SITE=${PYKV_H200_SITE:-/tmp/site}
PARTS=${PYKV_H200_PARTS:-/tmp/pykv-device}
TAG=$(printf '%s' "$STAGE" | tr -cd 'A-Za-z0-9')
mkdir -p "$WORK" "$OUTDIR"
say() { echo "[h200_run $(date +%H:%M:%S)] $*"; }

# the repository root: the benchmark beside pykv's connector (pykv/connector/ since the one-package
# layout; a checkout from before it has a top-level connector/)
if [ ! -f "$REPO/benchmarks/h200_connector.py" ] || { [ ! -d "$REPO/pykv/connector" ] && [ ! -d "$REPO/connector" ]; }; then
    echo "h200_run.sh: run me from the pykv repository root" >&2; exit 2
fi

export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
export PYTHONHASHSEED=0 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# NVLink multicast off (the shared multi-GPU hosts; stage T runs tensor parallel engines)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0

if [ "$STAGE" = report ]; then
    PYTHONPATH=$REPO python3 benchmarks/h200_connector.py report "$WORK/results.jsonl" --md "$OUTDIR/report.md"
    exit $?
fi

# 1. vLLM 0.26 into $SITE (a no-op when it is there)
if [ ! -d "$SITE/vllm" ]; then
    if [ -f "$PARTS/part2/install.sh" ]; then
        say "installing vLLM from $PARTS"
        bash "$PARTS/part2/install.sh" "$PARTS" || { echo "h200_run.sh: vLLM install failed" >&2; exit 3; }
    else
        echo "h200_run.sh: $SITE/vllm missing and no parts in $PARTS: send .device/part1, then" \
             ".device/part2 (benchmarks/README.md, steps 1 and 2)" >&2
        exit 3
    fi
fi

# 2. pykv as installed: pykv/ as it is (a snapshot from before the one-package layout also has
#    top-level connector/, jobs/ and commands/: they are put under pykv/ as its wheel did)
SHIM=$WORK/shim
rm -rf "$SHIM" && mkdir -p "$SHIM"
SRC=${PYKV_SRC:-$REPO}  # a snapshot of pykv/ (e.g. .device/snap; older ones also hold connector/) instead of the working tree
cp -r "$SRC/pykv" "$SHIM/pykv"
[ -d "$SRC/connector" ] && rm -rf "$SHIM/pykv/connector" && cp -r "$SRC/connector" "$SHIM/pykv/connector"
[ -d "$SRC/jobs" ] && rm -rf "$SHIM/pykv/jobs" && cp -r "$SRC/jobs" "$SHIM/pykv/jobs"
[ -d "$SRC/commands" ] && rm -rf "$SHIM/pykv/commands" && cp -r "$SRC/commands" "$SHIM/pykv/commands"
find "$SHIM" -name __pycache__ -type d -prune -exec rm -rf {} +
[ -d "$SHIM/pykv/connector" ] || { echo "h200_run.sh: $SRC has neither pykv/connector/ nor connector/" >&2; exit 2; }
export PYTHONPATH=$SHIM:$WORK/deps:$SITE
# which sources ran, in every JSON line (h200bench.util.emit): a label (PYKV_H200_SOURCE, default the
# snapshot's folder name or "worktree"), a digest of the laid-out .py files, and this command's run id
export PYKV_H200_SOURCE=${PYKV_H200_SOURCE:-$( [ -n "${PYKV_SRC:-}" ] && basename "$SRC" || echo worktree)}
PYKV_H200_SOURCE_DIGEST=$(cd "$SHIM" && find pykv -name '*.py' -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)
export PYKV_H200_SOURCE_DIGEST PYKV_H200_RUN_ID=${PYKV_H200_RUN_ID:-$TAG-$T0}
export PYKV_H200_SOURCE_COMMIT=$(cat "$SRC/COMMIT" 2>/dev/null)  # a snapshot's (h200_snapshot.sh)
say "sources: $PYKV_H200_SOURCE ($SRC${PYKV_H200_SOURCE_COMMIT:+ at $PYKV_H200_SOURCE_COMMIT}, digest $PYKV_H200_SOURCE_DIGEST), run $PYKV_H200_RUN_ID"

# 3. pykv's own needs the image may lack, from the wheels carried in .device/extra (one wheel per
#    missing module, --no-deps: what the image has is never shadowed): xxhash (the connector), blake3
#    (auth_key_file), sqlite-utils and its pure-Python deps (`pykv bench`, `pykv config`: the commands;
#    the connector imports it too, through pykv.maintenance), zstandard (codec planes-zstd)
EXTRA_MODULES="xxhash:xxhash blake3:blake3 sqlite_utils:sqlite_utils sqlite_fts4:sqlite_fts4 tabulate:tabulate
click_default_group:click_default_group dateutil:python_dateutil pluggy:pluggy click:click zstandard:zstandard"
for pair in $EXTRA_MODULES; do
    module=${pair%%:*} wheel=${pair#*:}
    python3 -c "import $module" 2>/dev/null && continue
    found=$(ls "$REPO"/.device/extra/"$wheel"-*.whl 2>/dev/null | head -1)
    if [ -z "$found" ]; then
        [ "$module" = xxhash ] && { echo "h200_run.sh: xxhash missing; carry .device/extra (benchmarks/README.md)" >&2; exit 3; }
        say "$module missing and no $wheel wheel in .device/extra: what needs it is skipped"
        continue
    fi
    say "installing $module from .device/extra"
    python3 -m pip install -q --no-deps --no-index --no-compile -t "$WORK/deps" "$found" \
        || { echo "h200_run.sh: $module install failed" >&2; exit 3; }
done

# 3a. NVIDIA nvCOMP (codec_decode: planes-zstd loads decoded on the GPU) where .device/nvcomp is carried
#     and the image lacks it: both wheels into $WORK/deps (``nvidia`` is a namespace package, so torch's
#     own nvidia/* libraries stay visible)
#     (or in /tmp/pykv-device/nvcomp, where an earlier command of the lease copied it: benchmarks/README.md)
NVCOMP_WHEELS=$REPO/.device/nvcomp
ls "$NVCOMP_WHEELS"/nvidia_*nvcomp*.whl >/dev/null 2>&1 || NVCOMP_WHEELS=/tmp/pykv-device/nvcomp
if ls "$NVCOMP_WHEELS"/nvidia_*nvcomp*.whl >/dev/null 2>&1 && ! python3 -c "from nvidia import nvcomp" 2>/dev/null; then
    say "installing nvCOMP from $NVCOMP_WHEELS"
    python3 -m pip install -q --no-deps --no-index --no-compile -t "$WORK/deps" "$NVCOMP_WHEELS"/nvidia_*nvcomp*.whl \
        || say "nvCOMP install failed: codec_decode=auto decodes on the CPU"
fi

# 3b. py-spy when PYKV_PYSPY names engines to profile (runner.profiled): its wheel from .device/extra
if [ -n "${PYKV_PYSPY:-}" ]; then
    # its own target: pip -t skips a wheel's bin/ when the target has one already (sqlite-utils')
    found=$(ls "$REPO"/.device/extra/py_spy-*.whl 2>/dev/null | head -1)
    [ -n "$found" ] && python3 -m pip install -q --no-deps --no-index --no-compile -t "$WORK/pyspy" "$found"
    export PATH=$WORK/pyspy/bin:$PATH
    if command -v py-spy >/dev/null; then
        say "py-spy from .device/extra: profiling engines whose label contains '$PYKV_PYSPY'"
    else
        say "PYKV_PYSPY: no py_spy wheel in .device/extra (or its install failed): no profiles"
    fi
fi

# 4. fail fast if the connector does not import against this vLLM
if ! (cd "$WORK" && PYTHONPATH=$REPO/benchmarks:$PYTHONPATH python3 -c \
        'import torch, vllm, pykv.connector.connector, pykv.connector.worker, h200_connector; print("imports ok: vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available(), "pykv.connector from", pykv.connector.__path__[0])'); then
    echo "h200_run.sh: import check failed" >&2; exit 4
fi
say "setup done in $(( $(date +%s) - T0 )) s; stage $STAGE, deadline in $(( T0 + BUDGET - $(date +%s) )) s"
[ "$STAGE" = setup ] && exit 0  # install and checks only: the next command's stage gets its whole budget

# 4b. optional: check and time pykv's CUDA copier outside vLLM first (benchmarks/h200_copy_check.py)
if [ "${PYKV_COPY_CHECK:-0}" = 1 ]; then
    (cd "$WORK" && timeout 120 python3 "$REPO/benchmarks/h200_copy_check.py" --out "$OUTDIR/copy_check.jsonl") \
        || say "copy check failed (rc $?)"
fi

# 5. the stage
SCRIPT=benchmarks/h200_connector.py
case "$STAGE" in
    P*|R) SCRIPT=benchmarks/h200_preload.py ;;  # P40, P80: the preloading bursts; R: round robin
    I) SCRIPT=benchmarks/h200_decode.py ;;      # issue 19: decode ITL beside background stores and loads
esac
python3 "$SCRIPT" stage "$STAGE" --work "$WORK" --out "$OUTDIR" --device-parts "$PARTS" \
    --deadline-at $(( T0 + BUDGET )) "$@"
rc=$?

# 6. what comes back: results.jsonl and report.md (written by the stage), logs
tar czf "$OUTDIR/logs-$TAG.tar.gz" -C "$WORK" logs cfg stats 2>/dev/null || true
[ -f "$WORK/results.jsonl" ] && cp "$WORK/results.jsonl" "$OUTDIR/results.jsonl"
say "stage $STAGE: rc $rc after $(( $(date +%s) - T0 )) s"
exit $rc
