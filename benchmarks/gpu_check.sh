#!/usr/bin/env bash
# Everything a short GPU lease should check, in one command from the repository root:
# - the `gpu` tests: kernels compiled, CUDA graphs, memory budget, HF oracle on CUDA, LoRA against
#   HF + PEFT, quantized layers, n-gram drafts, draft models and EAGLE-3 heads;
# - the kernels of a decode step (benchmarks.kernels) and a served-size engine's plan (benchmarks.gpu_plan);
# - FP8 and INT4 weights against bf16 on Llama-3.1-8B's shape (benchmarks.quant_gpu; QUANT_ARGS adds
#   options, e.g. --compile);
# - the GPU benchmark (random weights of Llama-3.2-1B's shape, bf16; BENCH_ARGS adds options);
# - what verifying k = 1..5 drafts costs a step on that shape (a random EAGLE-3 head whose drafts are
#   all rejected; benchmarks.speculative) and LoRA's cost per token there (benchmarks.lora).
# Logs and results go to $OUT. A step whose *_S limit is 0 is skipped.
#
# Wheels of packages the machine lacks (pydantic and its parts) may sit in .whl/.
# Ray is not needed: engine/ never imports it (tests/test_nvml.py does, so it is left out).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi

{
    nvidia-smi -L
    python3 - <<'EOF'
import inspect
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("no triton:", e)
from engine.attention.varlen import torch_varlen_kernel
k = torch_varlen_kernel()
print("varlen_attn", None if k is None else inspect.signature(k))
EOF
} 2>&1 | tee "$OUT/env.txt"

set -o pipefail
timeout "${PYTEST_S:-300}" python3 -m pytest -m gpu -q -rs --tb=short -p no:cacheprovider --timeout 150 \
    --junitxml="$OUT/pytest.xml" ${GPU_TESTS:-tests/test_attention_gpu.py tests/test_attention.py \
    tests/test_gpu_engine.py tests/test_cuda_graphs.py tests/test_memory_budget.py tests/test_lora.py \
    tests/test_gpu_quant.py tests/test_spec_decode.py tests/test_spec_draft.py tests/test_spec_eagle.py \
    tests/test_verify_graphs.py} \
    2>&1 | tee "$OUT/pytest.log"
echo "pytest exit: $?" | tee -a "$OUT/pytest.log"

if [ "${KERNELS_S:-120}" != 0 ]; then
    timeout "${KERNELS_S:-120}" python3 -m benchmarks.kernels --device cuda --model-shape llama-1b --levels 1,32 \
        2>&1 | tee "$OUT/kernels.log"
fi

if [ "${QUANT_S:-300}" != 0 ]; then  # products of one layer, then decode steps at 1 and 16 running
    timeout "${QUANT_S:-300}" python3 -m benchmarks.quant_gpu --model-shape llama-8b --json "$OUT/quant.json" \
        ${QUANT_ARGS:-} 2>&1 | tee "$OUT/quant.log"
fi

if [ "${PLAN_S:-120}" != 0 ]; then  # a served-size engine: kernel, gather buffer, graphs, KV pool
    timeout "${PLAN_S:-120}" python3 -m benchmarks.gpu_plan 2>&1 | tee "$OUT/plan.log"
fi

bench=/tmp/gpu-bench
if [ "${BENCH_S:-240}" != 0 ]; then
    timeout "${BENCH_S:-240}" python3 -m benchmarks --device cuda --dtype bfloat16 --model-shape llama-1b \
        --systems "${BENCH_SYSTEMS:-continuous,static,hf_generate_batch}" --out-dir "$bench" ${BENCH_ARGS:-} \
        2>&1 | tee "$OUT/bench.log"
    echo "bench exit: $?" | tee -a "$OUT/bench.log"
    cp "$bench"/results-*.json "$bench"/results-*.md "$OUT/" 2>/dev/null
    tar czf "$OUT/bench-logs.tgz" -C "$bench" logs 2>/dev/null
fi

if [ "${SPEC_S:-240}" != 0 ]; then  # ms a token at 1 and 16 running: off, then k = 1..5 drafts verified
    timeout "${SPEC_S:-240}" python3 -m benchmarks.speculative --device cuda --dtype bfloat16 --model-shape llama-1b \
        --methods off,eagle3 --k 1,2,3,4,5 --levels 1,16 --always --rounds 2 --max-tokens 32 \
        --out /tmp/gpu-spec/spec.json 2>&1 | tee "$OUT/spec.log"
    cp /tmp/gpu-spec/spec.json /tmp/gpu-spec/spec.png "$OUT/" 2>/dev/null
fi

# LoRA's cost, eager and then compiled with CUDA graphs (the base engine likewise in each).
for mode in eager compiled; do
    limit=$([ $mode = eager ] && echo "${LORA_S:-150}" || echo "${LORA_COMPILED_S:-240}")
    [ "$limit" = 0 ] && continue
    timeout "$limit" python3 -m benchmarks.lora --device cuda --dtype bfloat16 --model-shape llama-1b \
        --slots 64 --requests 128 --rounds 2 $([ $mode = compiled ] && echo --compiled) \
        --out /tmp/gpu-lora/lora-$mode.json 2>&1 | tee "$OUT/lora-$mode.log"
    cp /tmp/gpu-lora/lora-$mode.json "$OUT/" 2>/dev/null
done
true
