#!/usr/bin/env bash
# benchmarks/h200_snapshot.sh REV DEST — on this machine, from the repository root: pykv's sources at
# commit REV in DEST (a git-ignored folder under .device/, carried to the GPU host beside the working
# tree), for `PYKV_SRC=DEST bash benchmarks/h200_run.sh ...` or `PYKV_BA_SRC_<label>=DEST bash
# benchmarks/h200_before_after.sh ...`. Only the code the engines import: pykv/ and, before the
# one-package layout, the top-level connector/, jobs/, commands/ (no tests, no docs, ~1 MiB);
# DEST/COMMIT names the commit (h200_run.sh records it as `source_commit`).
set -euo pipefail
REV=${1:?usage: bash benchmarks/h200_snapshot.sh REV DEST   (e.g. b9727ea .device/snap-b9727ea)}
DEST=${2:?usage: bash benchmarks/h200_snapshot.sh REV DEST}
COMMIT=$(git rev-parse --verify "$REV^{commit}")
case "$DEST" in .device/*) ;; *) echo "h200_snapshot.sh: DEST must be under .device/ (git-ignored, carried)" >&2; exit 2;; esac
git check-ignore -q "$DEST" || { echo "h200_snapshot.sh: $DEST is not git-ignored" >&2; exit 2; }
folders=()
for f in pykv connector jobs commands; do
    [ "$(git ls-tree --name-only "$COMMIT" "$f")" = "$f" ] && folders+=("$f")
done
rm -rf "$DEST" && mkdir -p "$DEST"
git archive "$COMMIT" "${folders[@]}" | tar -x -C "$DEST"
echo "$COMMIT" > "$DEST/COMMIT"
echo "$DEST: ${folders[*]} at $COMMIT, $(du -sk "$DEST" | cut -f1) KiB"
