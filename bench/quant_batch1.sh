#!/usr/bin/env bash
# Batch-1 decode through the OpenAI API: tutorserve on the GGUF's own blocks and dequantized,
# and llama-server on the same GGUF, each at 2 and 1 compute threads, one server at a time.
# Each gets `tutorserve bench serve --workload random --max-concurrency 1` (8 requests, all
# queued at once, served one by one) and prints its mean TTFT and TPOT.
#
#   bash bench/quant_batch1.sh [OUT_DIR]      # needs .venv (make) and install_llama_server.sh
#   GGUF=/path/other.gguf bash bench/quant_batch1.sh [OUT_DIR]    # another GGUF than the default
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-/tmp/quant-batch1}"
mkdir -p "$OUT"
PY=.venv/bin/python
if [ -n "${GGUF:-}" ]; then
    NAME=$(basename "$GGUF" .gguf)
else
    NAME=smollm2-135m-instruct
    GGUF=$($PY -c "from tutorserve.models.registry import resolve; print(resolve('$NAME'))")
fi
LLAMA="${TUTORSERVE_CACHE:-$HOME/.cache/tutorserve}/peers/llama.cpp/bin/llama-server"
PORT=8617

run() {  # NAME COMMAND...: start a server, wait for it, measure, stop it
    local name=$1; shift
    "$@" > "$OUT/$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 120); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
    $PY -m tutorserve.cli bench serve --base-url "http://127.0.0.1:$PORT" \
        --model $NAME --tokenizer "$GGUF" --workload random --num-requests 8 --request-rate inf \
        --max-concurrency 1 --out "$OUT/$name.json" > /dev/null 2>&1
    kill "$pid"; wait "$pid" 2> /dev/null || true
    $PY -c "import json,sys; s=json.load(open(sys.argv[1]))['summary']; \
print(f\"{sys.argv[2]:32s} TTFT {s['mean_ttft_ms']:6.0f} ms  TPOT {s['mean_tpot_ms']:5.1f} ms\")" \
        "$OUT/$name.json" "$name"
}

serve=($PY -m tutorserve.cli serve --no-tutor --port $PORT --kv-disk-gb 0 --model "$GGUF"
       --served-model-name $NAME)
for t in 2 1; do
    run "tutorserve-gguf-t$t" "${serve[@]}" --quantization auto --num-threads $t
    run "tutorserve-dequantized-t$t" "${serve[@]}" --quantization none --num-threads $t
    run "llama-server-t$t" "$LLAMA" -m "$GGUF" -a $NAME --port $PORT -t $t \
        -c 8192 -np 1 --no-webui
done
