#!/usr/bin/env bash
# One device call (about 8 minutes) for run 14, most valuable first, each part under its own time limit;
# everything lands in $OUT/results.tgz, re-packed after every step (scripts/gpu_steps.sh), so a call cut off
# at its limit keeps what finished.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session.sh
# Run 13 (BENCHMARKS.md "Thirteenth H200 run") found:
# - form 1 costs a fixed ~33 us a launch (4k: 35 us for 4.8 MB), ~1 ms of a 32k step, then ~1.8 TB/s; so:
#   1. where a 4k launch spends it: ncu's source counters at 4k (per SASS instruction stall samples) and the
#      same launch with one split a head (MLXKV_CUDA_TARGET_BLOCKS=8: no in-launch merge across blocks) and
#      with 132 and 1056 target blocks, against the default 528;
# - turbo's first prompt spent 54 of 55 s in its admission checks (the reference built the portable path's
#   CUDA kernels); the checks now run their reference on the CPU. So:
#   2. the 128k prefill, turbo and affine:4 against mlx-lm, each first prompt's checks by name, and the checks
#      each 128k row ran (`checks`: a late first use or a steady cost of turbo's 0.53x);
# - the 32k decode run fell just outside the 140-190 band (138.5): 3. decode again, 32k and 128k.
# The whole suite is scripts/gpu_suite.sh (run it after this: it passed in run 13, 1355 tests).
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
python3 -c "import mlx.core as mx, mlx_lm; print('device', mx.default_device(), 'mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
step sections-4k 60 env OUT="$RES" CONTEXTS="4096" bash scripts/gpu_kernel_sections.sh
step ab-splits 100 env OUT="$RES" CONTEXTS="4096 131072" \
  VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_TARGET_BLOCKS=8 MLXKV_CUDA_TARGET_BLOCKS=132 MLXKV_CUDA_TARGET_BLOCKS=1056" \
  bash scripts/gpu_kernel_ab.sh
step prefill 150 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 131072 --repeats 1 --budget-s 145 \
  --output "$RES/h200-llama-8b-run14-prefill.json"
step bench 140 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill --repeats 3 --budget-s 125 \
  --only mlx-lm/bf16,mlxkv/affine:4/True,mlxkv/turbo:k4v3/True --output "$RES/h200-llama-8b-run14.json"
exit 0
