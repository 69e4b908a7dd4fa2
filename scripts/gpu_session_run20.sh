#!/usr/bin/env bash
# Run 20 (issues 13, 14), three warm calls of about 7 minutes each (PART a, c, b), after run 19's changes: form 3 the default
# for affine sides (cuda_mma.form_for), 32-bit in-row offsets in every tensor-core body.
# PART=a: 1. the kernel tests under the new default (run 19: 181 passed in form 1, 152 in form 3, 172 in form 2);
#         2. the decode bench at 32k and 128k, 3 repeats, mlx-lm bf16 in the same run (run 19: affine:4 1.10x at
#            128k in a run whose mlx-lm 32k baseline was out of band);
# PART=c: the kernel A/B under ncu at 4k, 32k and 128k: form 3 (the default), form 1, form 3 on scaled codes
#         (`MLXKV_CUDA_DEQ=scaled`, cuda_scaled.py: 641 -> 612 instructions a tile on CPU), form 3 at 5 blocks an
#         SM (96 registers, no spill since the 32-bit offsets) with 660 target blocks, and 264 target blocks (half the
#         splits: the ~14 us a launch costs beyond its bytes is a third of a 32k launch); then the kernel tests with
#         the scaled codes (they must pass before that variant can become a default).
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
elif [ "${PART}" = c ]; then
  step forms 290 env OUT="$RES" CONTEXTS="4096 32768 131072" VARIANTS="MLXKV_CUDA_MMA=3 MLXKV_CUDA_MMA=1 \
MLXKV_CUDA_DEQ=scaled MLXKV_CUDA_MIN_BLOCKS=5,MLXKV_CUDA_TARGET_BLOCKS=660 MLXKV_CUDA_TARGET_BLOCKS=264" \
    bash scripts/gpu_kernel_ab.sh
  step tests-scaled 150 env MLXKV_CUDA_DEQ=scaled python3 -m pytest -q -n 8 --timeout 120 -p no:cacheprovider \
    -p no:benchmark -rfE --tb=short tests/test_cuda_decode.py tests/test_cuda_steady.py
else
  step p8 170 python3 scripts/gpu_prefill_memory.py --p8
  step prefill 250 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 131072 --repeats 2 --budget-s 230 \
    --output "$RES/h200-llama-8b-run20-prefill.json"
fi
exit 0
