#!/usr/bin/env bash
# Run 21 (issues 13, 14), one warm call of about 9 minutes after staging:
# 1. the kernel tests with form 3's lean loop the default (cuda_lean.py: bit for bit form 3, 641 -> 567 instructions
#    a tile for affine:4 on CPU, 674 -> 569 for affine:8), its own bit-for-bit test first;
# 2. the kernel A/B under ncu at 4k / 32k / 128k (1 row) and 16 x 8k: lean against form 3's text (MLXKV_CUDA_LEAN=0);
# 3. P8 chunk by chunk with each bounded layer settled first (attention/settle.py; run 20e: every chunk ~0.9 GB above
#    the plan, 128k peak 11.63 GB against the 10 GiB budget);
# 4. P3's 128k prefill (bf16 weights) with and without the settle (MLXKV_LAYER_SYNC=0): what it costs in speed.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_run21.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=10 source scripts/gpu_steps.sh
step tests 130 python3 -m pytest -q -n 8 --timeout 120 -p no:cacheprovider -p no:benchmark -rfE --tb=short \
  tests/test_cuda_lean.py tests/test_cuda_decode.py tests/test_cuda_steady.py
step ab 110 env OUT="$RES" CONTEXTS="4096 32768 131072" VARIANTS="MLXKV_CUDA_LEAN=1 MLXKV_CUDA_LEAN=0" \
  bash scripts/gpu_kernel_ab.sh
step ab-rows 45 env OUT="$RES" ROWS=16 CONTEXTS="8192" VARIANTS="MLXKV_CUDA_LEAN=1 MLXKV_CUDA_LEAN=0" \
  bash scripts/gpu_kernel_ab.sh
step p8 150 python3 scripts/gpu_prefill_memory.py --p8-only --trace
step p3-settled 75 python3 scripts/gpu_prefill_memory.py --contexts 131072
step p3-unsettled 75 env MLXKV_LAYER_SYNC=0 python3 scripts/gpu_prefill_memory.py --contexts 131072
exit 0
