#!/usr/bin/env bash
# One device call (about 4 minutes): TurboQuant rows on the tensor-core decode body (kvcore/attention/
# cuda_turbo_mma.py, opt-in with MLXKV_CUDA_TURBO_MMA=1), checked and timed for the first time:
# 1. its device tests (cuda_check's admission check of 6 plans x 2 dtypes, two seeds) and the CPU fragment
#    emulation beside them;
# 2. scripts/gpu_kernel_ab.sh over turbo:k4v3 at 32k and 128k: the scalar body (shipped) against the new one;
# 3. scripts/gpu_bench.py at 32k with the new body (mlx-lm bf16 in the same run; its turbo:k4v3 kernel row is
#    the figure for P9; run 7: 21.8 tok/s on the scalar body against mlx-lm's 118).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_turbo.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=10 source scripts/gpu_steps.sh
step tests-turbo 80 env MLXKV_CUDA_TURBO_MMA=1 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 75 -rfEs \
  tests/test_cuda_turbo_mma.py
step ab-turbo 100 env OUT="$RES" KIND=turbo-kernel CONTEXTS="32768 131072" \
  VARIANTS="MLXKV_CUDA_TURBO_MMA=0 MLXKV_CUDA_TURBO_MMA=1" bash scripts/gpu_kernel_ab.sh
step bench-turbo 80 env MLXKV_CUDA_TURBO_MMA=1 python3 scripts/gpu_bench.py --contexts 32768 --no-prefill \
  --repeats 2 --budget-s 60 --output "$RES/h200-llama-8b-turbo-mma.json"
exit 0
