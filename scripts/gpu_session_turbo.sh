#!/usr/bin/env bash
# One device call (about 5 minutes): TurboQuant rows and affine 3/5/6-bit codes on the tensor-core decode body
# (kvcore/attention/cuda_turbo_mma.py, cuda_chunk_mma.py; opt-in with MLXKV_CUDA_TURBO_MMA=1 and
# MLXKV_CUDA_CHUNK_MMA=1), checked and timed for the first time:
# 1. their device tests (cuda_check's admission check, 6 and 5 plans x 2 dtypes, two seeds) and the CPU fragment
#    emulations beside them;
# 2. scripts/gpu_kernel_ab.sh over turbo:k4v3 and affine:3 at 32k and 128k: the scalar body (shipped) against the
#    new ones;
# 3. scripts/gpu_bench.py at 32k and 128k with the new body, mlx-lm bf16 and affine:4's kernel in the same run (the
#    turbo:k4v3 kernel row at 128k is P9's figure; run 7: 21.8 tok/s at 32k on the scalar body against mlx-lm's 118).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_turbo.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=10 source scripts/gpu_steps.sh
step tests-turbo 90 env MLXKV_CUDA_TURBO_MMA=1 MLXKV_CUDA_CHUNK_MMA=1 python3 -m pytest -q -p no:cacheprovider -n 8 \
  --timeout 85 -rfEs tests/test_cuda_turbo_mma.py tests/test_cuda_chunk_mma.py
step ab-turbo 100 env OUT="$RES" KIND=turbo-kernel CONTEXTS="32768 131072" \
  VARIANTS="MLXKV_CUDA_TURBO_MMA=0 MLXKV_CUDA_TURBO_MMA=1" bash scripts/gpu_kernel_ab.sh
step ab-chunk 100 env OUT="$RES" KIND=affine3-kernel CONTEXTS="32768 131072" \
  VARIANTS="MLXKV_CUDA_CHUNK_MMA=0 MLXKV_CUDA_CHUNK_MMA=1" bash scripts/gpu_kernel_ab.sh
step bench-turbo 110 env MLXKV_CUDA_TURBO_MMA=1 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill \
  --only mlx-lm/bf16,mlxkv/turbo:k4v3/True,mlxkv/affine:4/True --repeats 2 --budget-s 95 \
  --output "$RES/h200-llama-8b-turbo-mma.json"
exit 0
