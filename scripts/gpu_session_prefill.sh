#!/usr/bin/env bash
# One short device call (about 6.5 minutes) after run 12's turbo defaults (the one-launch encode and the
# tensor-core body on by default): the turbo body's 128k A/B that run 12's call cut off, the 128k prefill
# against mlx-lm bf16 in one call (issue 14: turbo:k4v3 was 0.57x in run 11), and the P8 memory case.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_prefill.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
step ab-turbo-128k 75 env OUT="$RES" KIND=turbo-kernel CONTEXTS="131072" \
  VARIANTS="MLXKV_CUDA_TURBO_MMA=1 MLXKV_CUDA_TURBO_MMA=0" bash scripts/gpu_kernel_ab.sh
step prefill 165 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 131072 --repeats 1 --budget-s 150 \
  --output "$RES/h200-llama-8b-run12-prefill.json"
step p8 165 python3 scripts/gpu_prefill_memory.py --p8
exit 0
