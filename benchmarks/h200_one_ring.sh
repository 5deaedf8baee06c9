#!/usr/bin/env bash
# Issue 17: does one io_uring on one thread (the reactor's shape) read a set of loop devices as fast
# as a ring and a thread per device (the O_DIRECT probe's shape)? On the H200 host, from the repo root:
#   bash benchmarks/h200_one_ring.sh [DEVICES=8] [FILE_GIB=2]
# Makes DEVICES ext4 loop devices on sparse images in /dev/shm, then `h200_connector.py mbw`: 28 MiB
# O_DIRECT reads at 8 and 16 in flight per device, per-device rings against one ring (engine
# io_uring-one-ring), three rounds interleaved, and the reactor over block files (verify header and
# full) beside them. Records in $OUT/one_ring.jsonl; torn down at the end. Needs xxhash and blake3 (.device/extra).
# PYKV_MBW_ENGINES replaces the read engines, e.g. adding the host's ceiling for a load's byte movements
# (read, hash, GPU copy; h200bench/ceiling.py, needs torch with CUDA):
#   PYKV_MBW_ENGINES=io_uring-one-ring,ceiling-h2d,ceiling-hash,ceiling-hash-h2d bash benchmarks/h200_one_ring.sh 8 2
# PYKV_MBW_CONFIGS replaces the read sizes and depths (BYTES:DEPTH,...; default 28 MiB at 8 and 16), e.g.
# fp8's stored 256-token block of the 3B shape: PYKV_MBW_CONFIGS=14909440:16,29360128:16
set -uo pipefail
N=${1:-8}; GIB=${2:-2}
OUTDIR=${OUT:-/tmp/pykv-one-ring}; mkdir -p "$OUTDIR"
DEPS=/tmp/pykv-one-ring-deps
for m in xxhash blake3; do
    python3 -c "import $m" 2>/dev/null || python3 -m pip install -q --no-deps --no-index -t "$DEPS" .device/extra/$m-*.whl
done
export PYTHONPATH=$(pwd):$DEPS${PYTHONPATH:+:$PYTHONPATH}
dirs=()
for i in $(seq 0 $((N - 1))); do
    img=/dev/shm/pykv-ring$i.img mnt=/mnt/pykv-ring$i
    truncate -s $((GIB + 2))G "$img" && dev=$(losetup -f --show "$img") || exit 3
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dev" && mkdir -p "$mnt" && mount "$dev" "$mnt" || exit 3
    echo "$dev $img $mnt" >> /tmp/pykv-ring-devices
    dirs+=("$mnt/mbw")
done
list=$(IFS=,; echo "${dirs[*]}")
timeout 400 python3 benchmarks/h200_connector.py mbw --results "$OUTDIR/one_ring.jsonl" --stage one-ring --dirs "$list" \
    --counts "$N" --configs ${PYKV_MBW_CONFIGS:-29360128:8,29360128:16} --engines ${PYKV_MBW_ENGINES:-io_uring,io_uring-one-ring} --size $((GIB << 30)) \
    --repeat 3 --files-size $((1 << 30)) --files-modes header,full --copy-threads ""
rc=$?
while read -r dev img mnt; do umount "$mnt"; losetup -d "$dev"; rm -f "$img"; done < /tmp/pykv-ring-devices
rm -f /tmp/pykv-ring-devices
python3 - "$OUTDIR/one_ring.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
groups = {}
for r in rows:
    if r.get("gb_per_s") is not None:
        groups.setdefault((r["what"], r["engine"], r.get("depth"), r.get("verify")), []).append(r["gb_per_s"])
for key, rates in sorted(groups.items(), key=str):
    print(*[k for k in key if k is not None], f"median {statistics.median(rates):.2f} GB/s of {rates}")
PY
exit $rc
