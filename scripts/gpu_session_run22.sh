#!/usr/bin/env bash
# Run 22 (issue 13), one warm call of about 4 minutes after staging: the lean loop's second pass (cuda_lean.py: no
# exp2f when no maximum moved, tiles inside every query's range skip the range tests) checked bit for bit against
# form 3 and under the kernel tests, then timed against form 3's text (MLXKV_CUDA_LEAN=0) at 32k and 128k
# (run 21's first pass: 31.6 / 84.9 us against 33.9 / 94.6).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_run22.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=10 source scripts/gpu_steps.sh
step tests 130 python3 -m pytest -q -n 8 --timeout 120 -p no:cacheprovider -p no:benchmark -rfE --tb=short \
  tests/test_cuda_lean.py tests/test_cuda_decode.py tests/test_cuda_steady.py
step ab 100 env OUT="$RES" CONTEXTS="131072 32768" VARIANTS="MLXKV_CUDA_LEAN=1 MLXKV_CUDA_LEAN=0" \
  bash scripts/gpu_kernel_ab.sh
exit 0
