#!/usr/bin/env bash
# Run 20 (issues 13, 14), two warm calls of about 8 minutes each, after run 19's changes: form 3 the default
# for affine sides (cuda_mma.form_for), 32-bit in-row offsets in every tensor-core body.
# PART=a: 1. the kernel tests under the new default (run 19: 181 passed in form 1, 152 in form 3, 172 in form 2);
#         2. the decode bench at 32k and 128k, 3 repeats, mlx-lm bf16 in the same run (run 19: affine:4 1.10x at
#            128k in a run whose mlx-lm 32k baseline was out of band);
#         3. forms 1 and 3 at 4k (form 3 has not been timed below 32k with the 32-bit offsets).
# PART=b: P8 and P3 (`gpu_prefill_memory.py --p8`: last 11.38 GB against 10), then the 128k prefill rows with the
#         delayed start repeated (run 16: 0.84x, one repeat).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder PART=a bash scripts/gpu_session_run20.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
if [ "${PART:-a}" = a ]; then
  step tests 200 python3 -m pytest -q -n 8 --timeout 150 -p no:cacheprovider -p no:benchmark -rfE --tb=short \
    tests/test_cuda_decode.py tests/test_cuda_steady.py tests/test_cuda_turbo_decode.py tests/test_cuda_stage.py
  step bench 190 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill --repeats 3 --budget-s 170 \
    --only mlx-lm/bf16,mlxkv/affine:4/True,mlxkv/affine:8/True,mlxkv/turbo:k4v3/True \
    --output "$RES/h200-llama-8b-run20.json"
  step forms-4k 50 env OUT="$RES" CONTEXTS="4096" VARIANTS="MLXKV_CUDA_MMA=3 MLXKV_CUDA_MMA=1" bash scripts/gpu_kernel_ab.sh
else
  step p8 170 python3 scripts/gpu_prefill_memory.py --p8
  step prefill 250 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 131072 --repeats 2 --budget-s 230 \
    --output "$RES/h200-llama-8b-run20-prefill.json"
fi
exit 0
