#!/usr/bin/env bash
# Every GPU-marked test and the GPU benchmarks, in one go, on a CUDA host.
#
#   tools/gpu_checks.sh [TOKENIZER_DIR]
#
# Results (logs and tables) go under $OUT (default ./gpu-results). The LoRA
# benchmark's random Llama-3.2-1B-shaped model uses SmolLM2's vocabulary, so
# it needs SmolLM2's tokenizer files: TOKENIZER_DIR, else the fetched
# embedded model. Steps are independent: one failing step doesn't stop the
# others, and the script exits non-zero if any failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TOKENIZER=${1:-}
status=0
if ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "tools/gpu_checks.sh needs a CUDA device and torch built for it ($PY sees none); run it on a GPU host" >&2
    exit 2
fi
mkdir -p "$OUT"

step() {  # step NAME COMMAND...: run, log to $OUT/NAME.txt, print the tail
    local name=$1; shift
    echo "==> $name: $*"
    local t0=$SECONDS
    "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n "${TAIL:-25}" "$OUT/$name.txt"
    echo "<== $name: exit $rc after $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || status=1
}

$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
step gpu_tests $PY -m pytest -q -m gpu -p no:cacheprovider tests    # the two-GPU ones skip on one
step attention_kernels $PY tools/check_attention_kernels.py
step linear_kernels $PY tools/check_linear_kernels.py
step lora_kernels $PY tools/check_lora_kernels.py --decode --output "$OUT/lora_decode.json"
step lora_folds $PY tools/check_lora_kernels.py --fold-table --output "$OUT/lora_folds.json"
step sampling $PY tools/bench_sampling.py --device cuda --rows 8 64 256
step gpu_step $PY tools/profile_gpu_step.py --no-profile ${TOKENIZER:+--tokenizer "$TOKENIZER"}
# four frontend processes (server.api_server_count): one would bound c=32-64 on a GPU
step bench_lora $PY tools/bench_lora.py --model llama-3.2-1b-random --device cuda --api-servers 4 \
    ${TOKENIZER:+--tokenizer "$TOKENIZER"} --output "$OUT/bench_lora_table.txt"
step bench_prepare $PY tools/bench_prepare.py --output "$OUT/bench_prepare.md"
exit $status
