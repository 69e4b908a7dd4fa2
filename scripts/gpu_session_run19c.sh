#!/usr/bin/env bash
# Run 19's third call (about 3 minutes): forms 1 / 2 / 3 at 64k and 128k under ncu with the 32-bit offsets (the
# second call's limit cut form 3 off), and the 32k step's plain timings for turbo:k4v3 (run 19's bench put turbo
# at 0.57x / 0.59x against run 18's 0.70x / 0.80x with no change to its path but the offsets: host or kernel?).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_run19c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
step plain 90 python3 scripts/gpu_trace_step.py --context 32768 --steps 32 \
  --cases model:mlx-lm,model:turbo-kernel,engine:turbo-kernel,engine:affine4-kernel
step forms 110 env OUT="$RES" CONTEXTS="65536 131072" \
  VARIANTS="MLXKV_CUDA_MMA=3 MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2" bash scripts/gpu_kernel_ab.sh
exit 0
