#!/usr/bin/env bash
# One device call (under 9 minutes): TurboQuant's decode on the tensor cores and its prefill at 128k.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_turbo.sh
# 0. end to end over affine:3 (the code-chunk body, default since run 11, in a model for the first time);
# 1. scripts/gpu_kernel_ab.sh over turbo:k4v3 at 32k and 128k: the scalar body (default) against the tensor-core
#    body (MLXKV_CUDA_TURBO_MMA=1; run 11: equal to the reference, 32k bimodal, its 128k case cut off);
# 2. why turbo's prefill loses ~178 ms a chunk at 128k but ~25 ms at 32k (run 11: 0.57x mlx-lm at 128k), chunk by
#    chunk (scripts/gpu_prefill_probe.py --context 131072, one pass a scheme, no engine pass);
# 3. the same probe at 32k in a second process: the decode kernel's first use (last chunk less the decode step)
#    with MLX's PTX cache on disk warm from the process before (run 11's first pass: 7.9 s in affine:4's last chunk);
# 4. scripts/gpu_bench.py at 32k and 128k, turbo:k4v3's kernel row with the tensor-core body against mlx-lm bf16 in
#    the same run (P9: >= 1.3x at 128k; run 11: 0.64x).
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=10 source scripts/gpu_steps.sh
step e2e-affine3 35 python3 scripts/gpu_kernel_e2e.py --shape llama-1b --scheme affine:3 --steps 200
step ab-turbo 170 env OUT="$RES" KIND=turbo-kernel CONTEXTS="32768 131072" \
  VARIANTS="MLXKV_CUDA_TURBO_MMA=0 MLXKV_CUDA_TURBO_MMA=1" bash scripts/gpu_kernel_ab.sh
step probe-128k 150 python3 scripts/gpu_prefill_probe.py --context 131072 --passes 1 --no-engine
step probe-32k-again 80 python3 scripts/gpu_prefill_probe.py --context 32768 --passes 1 --no-engine
step bench-turbo 110 env MLXKV_CUDA_TURBO_MMA=1 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill \
  --only mlx-lm/bf16,mlxkv/turbo:k4v3/True --repeats 3 --budget-s 95 --output "$RES/h200-llama-8b-run12-turbo.json"
exit 0
