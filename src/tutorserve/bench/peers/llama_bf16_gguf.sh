#!/usr/bin/env bash
# Convert a Hugging Face model directory to a bf16 GGUF for llama-server, with the converter of
# the llama.cpp tree that src/tutorserve/bench/peers/install_llama_server.sh unpacked (its convert_hf_to_gguf.py
# and its own gguf-py, which must match that tree, hence PYTHONPATH).
#
# Usage: src/tutorserve/bench/peers/llama_bf16_gguf.sh HF_DIR OUT.gguf
# Idempotent: does nothing if OUT exists. Writes OUT.tmp and renames it into place.
# Env: TUTORSERVE_CACHE, PYTHON (needs torch, numpy, safetensors, transformers; default: the
#      repo's .venv, else python3.11).
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 HF_DIR OUT.gguf" >&2
    exit 2
fi
HF_DIR="$1"
OUT="$2"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SRC="$CACHE/peers/llama.cpp/src"

log() { echo "[llama_bf16_gguf] $*" >&2; }

if [[ -s "$OUT" ]]; then
    log "already present: $OUT"
    exit 0
fi
[[ -f "$HF_DIR/config.json" ]] || { log "$HF_DIR has no config.json"; exit 1; }
[[ -f "$SRC/convert_hf_to_gguf.py" ]] || {
    log "no $SRC/convert_hf_to_gguf.py: run src/tutorserve/bench/peers/install_llama_server.sh first"
    exit 1
}

mkdir -p "$(dirname "$OUT")"
log "converting $HF_DIR -> $OUT (bf16)"
rm -f "$OUT.tmp"
PYTHONPATH="$SRC/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$SRC/convert_hf_to_gguf.py" \
    "$HF_DIR" --outtype bf16 --outfile "$OUT.tmp" >"$OUT.log" 2>&1 \
    || { tail -n 30 "$OUT.log" >&2; rm -f "$OUT.tmp"; exit 1; }
mv -f "$OUT.tmp" "$OUT"
log "wrote $OUT ($(du -h "$OUT" | cut -f1); log: $OUT.log)"
