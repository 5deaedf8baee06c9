#!/usr/bin/env bash
# benchmarks/h200_before_after.sh ORDER [options of `h200_connector.py stage`]
#
# Two (or more) pykv sources side by side in one device command, on the GPU host after
# `h200_run.sh setup`: stage C once per label of ORDER, in turn (each a `h200_run.sh C`: a fresh
# loop device in /dev/shm, its O_DIRECT probe, a pykv fill engine, page cache dropped, a fresh query
# engine with a disk hit then a DRAM hit per document), then the report with the sources side by
# side (`h200_connector.py sources`: disk-hit and DRAM-hit TTFT per length and source, the ratio to
# the baseline, the spread between runs of one source). Issue 37: before,after,before then
# after,before,after (benchmarks/README.md, "Issue 37 before/after").
#
#   ORDER   comma list of labels, run in that order (letters, digits, _), e.g. before,after,before
#
# A label's sources: PYKV_BA_SRC_<label>, a folder holding pykv/ (a snapshot from before the
# one-package layout also holds connector/, jobs/, commands/; h200_run.sh lays them out); default
# .device/snap-b9727ea for `before`, the working tree for any other label. A label's own stage
# options: PYKV_BA_OPTS_<label> (e.g. PYKV_BA_OPTS_zstd="--pykv-set codec=planes-zstd"); the
# options after ORDER go to every run, after --no-verify-full (header-verified hits only).
# Time: PYKV_BA_BUDGET_S (570) for the whole command; a run gets what is left less PYKV_BA_RUN_S
# (170) for each run after it, and is skipped (said so) when less than PYKV_BA_RUN_S is left.
# Each record carries `source` (the label), `source_digest` and `source_run` (h200_run.sh);
# $OUT gets results.jsonl (every run of the lease so far), report.md, sources.md, each run's logs.
set -uo pipefail
T0=$(date +%s)
ORDER=${1:?usage: bash benchmarks/h200_before_after.sh ORDER (e.g. before,after,before) [stage options]}
shift
REPO=$(pwd)
WORK=${PYKV_H200_WORK:-/tmp/pykv-h200}
OUTDIR=${OUT:-$WORK/out}
BUDGET=${PYKV_BA_BUDGET_S:-570}
RUN_S=${PYKV_BA_RUN_S:-170}
mkdir -p "$WORK" "$OUTDIR"
say() { echo "[before_after $(date +%H:%M:%S)] $*"; }

IFS=, read -r -a LABELS <<< "$ORDER"
for label in "${LABELS[@]}"; do
    [[ $label =~ ^[A-Za-z0-9_]+$ ]] || { echo "h200_before_after.sh: bad label '$label'" >&2; exit 2; }
done
source_of() {  # the folder of label $1's sources ("" = the working tree)
    local var="PYKV_BA_SRC_$1"
    if [ -n "${!var:-}" ]; then echo "${!var}"
    elif [ "$1" = before ]; then echo .device/snap-b9727ea
    else echo ""; fi
}
for label in "${LABELS[@]}"; do  # refuse a missing snapshot before any run
    src=$(source_of "$label")
    if [ -n "$src" ] && [ ! -d "$src/pykv" ]; then
        echo "h200_before_after.sh: $label: no $src/pykv (carry the snapshot: benchmarks/README.md)" >&2; exit 2
    fi
done

n=${#LABELS[@]} rc_all=0
declare -A BROKEN=()  # labels whose setup or import check failed (h200_run.sh rc 2-4): not run again
for i in "${!LABELS[@]}"; do
    label=${LABELS[$i]}
    if [ -n "${BROKEN[$label]:-}" ]; then
        say "run $((i + 1))/$n ($label): skipped, its sources failed to set up or import before"
        continue
    fi
    left=$(( T0 + BUDGET - $(date +%s) ))
    later=$(( n - i - 1 ))
    if [ "$left" -lt "$RUN_S" ]; then
        say "run $((i + 1))/$n ($label): skipped, $left s left (< $RUN_S)"
        continue
    fi
    budget=$(( left - later * RUN_S ))
    [ "$budget" -lt "$RUN_S" ] && budget=$RUN_S
    src=$(source_of "$label") opts_var="PYKV_BA_OPTS_$label"
    run_id="$label-$((i + 1))-$(date +%s)"
    say "run $((i + 1))/$n: $label (sources ${src:-working tree}), budget $budget s, $left s left"
    # shellcheck disable=SC2086  # the options are words
    env -u PYKV_SRC ${src:+PYKV_SRC=$src} PYKV_H200_SOURCE="$label" PYKV_H200_RUN_ID="$run_id" PYKV_H200_BUDGET_S="$budget" \
        bash benchmarks/h200_run.sh C --no-verify-full "$@" ${!opts_var:-}
    rc=$?
    [ "$rc" -ne 0 ] && rc_all=$rc && say "run $((i + 1)) ($label): rc $rc"
    case "$rc" in 2|3|4) BROKEN[$label]=1 ;; esac
    tar czf "$OUTDIR/logs-$run_id.tar.gz" -C "$WORK" logs cfg 2>/dev/null || true
done

# the whole report (report.md) and the sources side by side (sources.md), over every run so far
if [ -f "$WORK/results.jsonl" ]; then
    cp "$WORK/results.jsonl" "$OUTDIR/results.jsonl"
    (PYTHONPATH=$REPO:$WORK/deps python3 benchmarks/h200_connector.py report "$WORK/results.jsonl" \
        --md "$OUTDIR/report.md" > "$OUTDIR/report.txt" 2>&1) || say "report failed"
    PYTHONPATH=$REPO:$WORK/deps python3 benchmarks/h200_connector.py sources "$WORK/results.jsonl" --md "$OUTDIR/sources.md"
fi
say "done in $(( $(date +%s) - T0 )) s (rc $rc_all)"
exit $rc_all
