#!/usr/bin/env bash
# One device call (about 8 minutes): TurboQuant's decode and prefill with its one-launch encode, most valuable first.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_turbo.sh
# Built on CPU after run 11 (BENCHMARKS.md): turbo's steady layers launch from their cache's recipe (host cost of
# attention per layer about halved), and MLXKV_CUDA_TURBO_ENCODE=1 encodes a K or V in one launch instead of 18
# MLX nodes (equal to the portable encode up to float rounding, admitted per shape on the device). So:
# 1. the encode launch's device tests (tests/test_turbo_cuda_encode.py: every bits 1-8 x dim x dtype admitted, and
#    its decode error no worse than the portable encode's);
# 2. scripts/gpu_bench.py at 32k and 128k: turbo:k4v3's kernel row with the encode launch and the tensor-core body
#    against mlx-lm bf16 in the same run (P9: >= 1.3x at 128k; run 11: 70.0 and 73.6 tok/s, 0.51x and 0.64x);
# 3. turbo's prefill chunk by chunk at 128k with the encode launch (scripts/gpu_prefill_probe.py, one raw pass a
#    scheme, then the engine's pass under its memory plan: run 11 lost ~178 ms a chunk to affine:4 there, ~25 ms at
#    32k, and the pieces explain ~70; a raw pass near affine's with a slow engine pass points at the memory limit);
# 4. scripts/gpu_kernel_ab.sh over turbo:k4v3 at 32k and 128k: the scalar body (default) against the tensor-core
#    body (MLXKV_CUDA_TURBO_MMA=1; run 11: equal to the reference, 32k bimodal, its 128k case cut off);
# 5. end to end over affine:3 (the code-chunk body, default since run 11, in a model for the first time).
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=10 source scripts/gpu_steps.sh
step tests-turbo-encode 45 python3 -m pytest -q -p no:cacheprovider -n 16 --timeout 40 -rfEs tests/test_turbo_cuda_encode.py
step bench-turbo 110 env MLXKV_CUDA_TURBO_MMA=1 MLXKV_CUDA_TURBO_ENCODE=1 python3 scripts/gpu_bench.py \
  --contexts 32768,131072 --no-prefill --only mlx-lm/bf16,mlxkv/turbo:k4v3/True,mlxkv/affine:4/True --repeats 3 \
  --budget-s 95 --output "$RES/h200-llama-8b-run12-turbo.json"
step probe-128k 150 env MLXKV_CUDA_TURBO_ENCODE=1 python3 scripts/gpu_prefill_probe.py --context 131072 --passes 1
step ab-turbo 120 env OUT="$RES" KIND=turbo-kernel CONTEXTS="32768 131072" \
  VARIANTS="MLXKV_CUDA_TURBO_MMA=0 MLXKV_CUDA_TURBO_MMA=1" bash scripts/gpu_kernel_ab.sh
step e2e-affine3 35 python3 scripts/gpu_kernel_e2e.py --shape llama-1b --scheme affine:3 --steps 200
exit 0
