#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` (the batching, multi-slot server) as a peer engine.
#
# The sources come from the llama-cpp-python sdist on PyPI (its vendor/llama.cpp tree): the
# registry is the only network we have, and the sdist pins one llama.cpp commit. The binary is
# static (BUILD_SHARED_LIBS=OFF) and built with GGML_NATIVE (-march=native): it runs on this CPU
# type only. See shared/notes/peers.md (section llama.cpp).
#
# Installs:   $CACHE/peers/llama.cpp/bin/llama-server
#             $CACHE/peers/llama.cpp/src   (the vendor tree: convert_hf_to_gguf.py, gguf-py)
# Idempotent: if the binary exists and runs, it does nothing. Last line printed: the binary's path.
#
# Usage: src/tutorserve/bench/peers/install_llama_server.sh [--bf16-gguf]
#   --bf16-gguf  also write $CACHE/peers/llama.cpp/smollm2-135m-instruct-bf16.gguf (the default
#                model exported to a HF dir by tutorserve.bench.hf_export, then converted to bf16
#                by src/tutorserve/bench/peers/llama_bf16_gguf.sh) for a like-for-like comparison with our engine.
# Env: TUTORSERVE_CACHE, LLAMA_CPP_PYTHON_VERSION (default 0.3.36), PYTHON (a python3.11 with pip;
#      default: the repo's .venv, else python3.11), LLAMA_BUILD_JOBS (default 2).
# Build: ~6-11 min on 2 cores (665 s measured, llama-cpp-python 0.3.36, with other load on the box).
# Disk: ~270 MB src/ (sources + 90 MB build tree), 74 MB sdist/, 15 MB binary.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
PEER="$CACHE/peers/llama.cpp"
BIN="$PEER/bin/llama-server"
SRC="$PEER/src"
JOBS="${LLAMA_BUILD_JOBS:-2}"

log() { echo "[install_llama_server] $*" >&2; }

WANT_BF16=0
for arg in "$@"; do
    case "$arg" in
        --bf16-gguf) WANT_BF16=1 ;;
        -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) log "unknown argument: $arg"; exit 2 ;;
    esac
done

bf16_gguf() {
    local out="$PEER/smollm2-135m-instruct-bf16.gguf" hf
    if [[ -s "$out" ]]; then
        log "bf16 GGUF already present: $out"
        return 0
    fi
    log "exporting the default model to a HF dir (cached under $CACHE/hf)"
    hf="$(cd "$REPO" && TUTORSERVE_CACHE="$CACHE" "$PYTHON" -c '
import os
from tutorserve.bench.hf_export import export_gguf_to_hf
from tutorserve.models.registry import DEFAULT_MODEL, resolve
print(export_gguf_to_hf(str(resolve(DEFAULT_MODEL)),
      os.path.join(os.environ["TUTORSERVE_CACHE"], "hf", DEFAULT_MODEL)))
' | tail -n 1)"
    PYTHON="$PYTHON" TUTORSERVE_CACHE="$CACHE" "$HERE/llama_bf16_gguf.sh" "$hf" "$out"
}

if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1; then
    log "llama-server already installed: $BIN (delete $PEER to rebuild)"
    [[ "$WANT_BF16" == 1 ]] && bf16_gguf
    echo "$BIN"
    exit 0
fi

mkdir -p "$PEER/bin" "$PEER/sdist"
STAMP="$SRC/.llama-cpp-python-version"

# 1. Sources: the vendor tree of the pinned llama-cpp-python sdist.
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$LLAMA_CPP_PYTHON_VERSION" && -f "$SRC/CMakeLists.txt" ]]; then
    log "sources of llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already unpacked in $SRC"
else
    SDIST="$(ls "$PEER/sdist"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz 2>/dev/null || true)"
    if [[ -z "$SDIST" ]]; then
        log "downloading the llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist"
        "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
            -d "$PEER/sdist" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        SDIST="$(ls "$PEER/sdist"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION".tar.gz)"
    fi
    log "unpacking $SDIST"
    TMP="$(mktemp -d "$PEER/.unpack-XXXXXX")"
    trap 'rm -rf "$TMP"' EXIT
    tar -xzf "$SDIST" -C "$TMP"
    VENDOR="$TMP/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
    [[ -f "$VENDOR/CMakeLists.txt" ]] || { log "no vendor/llama.cpp in $SDIST"; exit 1; }
    echo "$LLAMA_CPP_PYTHON_VERSION" > "$VENDOR/.llama-cpp-python-version"
    rm -rf "$SRC"
    mv "$VENDOR" "$SRC"
    rm -rf "$TMP"
    trap - EXIT
fi

# 2. Build only the server target (static, native CPU flags, no curl, no web UI download).
log "configuring (cmake) in $SRC/build"
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$PEER/cmake-configure.log" 2>&1 \
    || { tail -n 40 "$PEER/cmake-configure.log" >&2; exit 1; }
log "building llama-server with -j$JOBS (~6-11 min on 2 cores; log: $PEER/cmake-build.log)"
START=$SECONDS
cmake --build "$SRC/build" -j"$JOBS" --target llama-server >"$PEER/cmake-build.log" 2>&1 \
    || { tail -n 40 "$PEER/cmake-build.log" >&2; exit 1; }
log "built in $((SECONDS - START)) s"

# 3. Install the binary atomically, then check it runs.
install -m 0755 "$SRC/build/bin/llama-server" "$BIN.tmp"
mv -f "$BIN.tmp" "$BIN"
"$BIN" --version 2>&1 | sed 's/^/[install_llama_server]   /' >&2
log "installed $BIN"
[[ "$WANT_BF16" == 1 ]] && bf16_gguf
echo "$BIN"
