#!/usr/bin/env bash
# `vllm bench serve` (vLLM's own load client) against `vllm serve`, `slotserve serve` and llama.cpp's
# `llama-server`, one after the other, same model, same requests. Results: $OUT/{vllm,slotserve,llamacpp}.json
# and .log.
#
#   VLLM_VENV=/tmp/peer/venv bash benchmarks/served_vs_vllm.sh [extra `vllm serve` args, e.g. --dtype float32]
#   SYSTEMS="llamacpp slotserve" SLOTSERVE_CONFIG=gguf.yaml bash benchmarks/served_vs_vllm.sh
#
# LLAMACPP_DIR: llama.cpp's build (../shared/peers/setup-llamacpp.sh; binaries in $LLAMACPP_DIR/bin);
# GGUF_FILE: the file llama-server serves (default: the built-in model's own, the one
# `quantization: gguf` reads), with -np $CONCURRENCY slots, 1024 tokens of context each, $THREADS threads.
#
# SLOTSERVE_CONFIG: the Serve config `slotserve serve` runs (default its own, configs/local-cpu.yaml);
# e.g. a copy with `kv_cache_dtype: int8` under `engine:`, against `--kv-cache-dtype fp8` for vLLM.
# SLOTSERVE_ARGS: more `slotserve serve` options, e.g. --speculative-config '{"method": "ngram", ...}'.
# DATASET_ARGS: the requests (default: random, 256 tokens in, 128 out); e.g. the copy-heavy prompts of
# benchmarks.copy_dataset: --dataset-name custom --dataset-path copy.jsonl --custom-output-len 128.
#
# VLLM_VENV: a venv with vLLM's CPU build (benchmarks/peers/setup-vllm-cpu.sh makes one). MODEL_DIR:
# default the converted default model. Each server starts at its defaults (plus the extra args
# for vLLM) and is stopped before the next one starts.
set -euo pipefail
VLLM_VENV=${VLLM_VENV:-/tmp/peer/venv}
OUT=${OUT:-bench-out/served-vs-vllm}
MODEL_DIR=${MODEL_DIR:-$(python -c "from engine.models_hub import resolve_model; print(resolve_model('smollm2-135m'))")}
PROMPTS=${PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-16}
THREADS=${THREADS:-$(nproc)}
SYSTEMS=${SYSTEMS:-vllm slotserve}  # one of them alone: SYSTEMS=slotserve; llama.cpp: SYSTEMS=llamacpp
LLAMACPP_DIR=${LLAMACPP_DIR:-/tmp/peer/llamacpp}
GGUF_FILE=${GGUF_FILE:-$(python -c "from engine.models_hub import resolve_gguf; print(resolve_gguf('smollm2-135m', None, None))")}
DATASET_ARGS=${DATASET_ARGS:---dataset-name random --random-input-len 256 --random-output-len 128}
mkdir -p "$OUT"

wait_ready() {  # base url, served model name, seconds, server pid
  # A one-token completion, not /v1/models: an ingress can list models while its engine still
  # loads or compiles, and startup is counted to the first token either server can give.
  local body="{\"model\": \"$2\", \"prompt\": \"Hello\", \"max_tokens\": 1}"
  for _ in $(seq "$3"); do
    curl -sf -m 600 "$1/v1/completions" -H 'content-type: application/json' -d "$body" >/dev/null && return 0
    kill -0 "$4" 2>/dev/null || { echo "the server exited before it answered; see $OUT" >&2; return 1; }
    sleep 1
  done
  echo "no completion from $1 within $3 s" >&2; return 1
}

bench() {  # name, base url, served model name
  "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "$2" --model "$3" --tokenizer "$MODEL_DIR" \
    $DATASET_ARGS --num-prompts "$PROMPTS" \
    --max-concurrency "$CONCURRENCY" --ignore-eos --save-result --result-dir "$OUT" --result-filename "$1.json" \
    2>&1 | tee "$OUT/$1-bench.log"
}

stop() { kill -INT "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

run_vllm() {
start=$(date +%s)
VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
  "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --port 8100 "$@" >"$OUT/vllm.log" 2>&1 &
pid=$!
wait_ready http://127.0.0.1:8100 "$MODEL_DIR" 900 $pid
echo "vllm serve gave its first token $(( $(date +%s) - start )) s after its start" | tee "$OUT/vllm-ready.txt"
bench vllm http://127.0.0.1:8100 "$MODEL_DIR"
stop $pid
}

run_slotserve() {
start=$(date +%s)
eval "exec slotserve serve ${SLOTSERVE_CONFIG:+--config \"$SLOTSERVE_CONFIG\"} ${SLOTSERVE_ARGS:-}" >"$OUT/slotserve.log" 2>&1 &
pid=$!
wait_ready http://127.0.0.1:8000 smollm2-135m 900 $pid
echo "slotserve serve gave its first token $(( $(date +%s) - start )) s after its start" | tee "$OUT/slotserve-ready.txt"
bench slotserve http://127.0.0.1:8000 smollm2-135m
stop $pid
}

run_llamacpp() {
start=$(date +%s)
"$LLAMACPP_DIR/bin/llama-server" -m "$GGUF_FILE" -np "$CONCURRENCY" -c $((1024 * CONCURRENCY)) -t "$THREADS" \
  --host 127.0.0.1 --port 8200 --alias smollm2-135m >"$OUT/llamacpp.log" 2>&1 &
pid=$!
wait_ready http://127.0.0.1:8200 smollm2-135m 300 $pid
echo "llama-server gave its first token $(( $(date +%s) - start )) s after its start" | tee "$OUT/llamacpp-ready.txt"
bench llamacpp http://127.0.0.1:8200 smollm2-135m
stop $pid
}

for system in $SYSTEMS; do "run_$system" "$@"; done
