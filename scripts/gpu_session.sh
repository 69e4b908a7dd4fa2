#!/usr/bin/env bash
# One device call (about 8 minutes) for run 13, most valuable first, each part under its own time limit;
# everything lands in $OUT/results.tgz, re-packed after every step (scripts/gpu_steps.sh), so a call cut off
# at its limit keeps what finished.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session.sh
# Run 12 made turbo's tensor-core body and one-launch encode the defaults and found a turbo prompt's first
# use costing ~26 s of kernel builds and checks (gpu_bench.py warmed nothing for it). So:
# 1. the 128k prefill against mlx-lm bf16 with every scheme warmed on a 4k prompt first: issue 14's steady
#    ratios (affine:4 >= 0.9x, turbo:k4v3 >= 0.7x) and each first prompt's builds and checks by name
#    (`first_prompt.checks` in the JSON: backend.CHECKS);
# 2. decode at 32k and 128k, 3 interleaved repeats, mlx-lm bf16 against affine:4 and turbo:k4v3 on the kernel
#    (issue 13's P2 and P9 with the new defaults);
# 3. ncu's stall reasons of the affine:4 kernel at 32k (where it streams at 0.61 TB/s);
# 4. form 1 asking L2 for each warp's next tile (MLXKV_CUDA_PREFETCH=3, new, built on CPU: 127 registers at
#    4 blocks an SM, three CCTL.E.PF2 at the tile's start, form 1's loads and arithmetic unchanged): its device
#    tests (bit for bit form 1), then the A/B at 32k and 128k against form 1, one tile and two tiles ahead
#    (MLXKV_CUDA_L2_AHEAD=2). Form 1 at 4k and 16k is in scripts/gpu_session_after.sh.
# The whole suite is scripts/gpu_suite.sh (run it after this: serve's prefix cache now pins pages).
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
python3 -c "import mlx.core as mx, mlx_lm; print('device', mx.default_device(), 'mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
step prefill 190 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 131072 --repeats 1 --budget-s 185 \
  --output "$RES/h200-llama-8b-run13-prefill.json"
step bench 140 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill --repeats 3 --budget-s 125 \
  --only mlx-lm/bf16,mlxkv/affine:4/True,mlxkv/turbo:k4v3/True --output "$RES/h200-llama-8b-run13.json"
step stalls 45 env OUT="$RES" MODE=stalls CONTEXTS="32768" VARIANTS="MLXKV_CUDA_MMA=1" bash scripts/gpu_kernel_ab.sh
step tests-prefetch 85 python3 -m pytest -q -p no:cacheprovider -n 16 --timeout 80 -rfEs tests/test_cuda_prefetch.py
step ab-l2 110 env OUT="$RES" CONTEXTS="32768 131072" \
  VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_PREFETCH=3 MLXKV_CUDA_PREFETCH=3,MLXKV_CUDA_L2_AHEAD=2" bash scripts/gpu_kernel_ab.sh
exit 0
