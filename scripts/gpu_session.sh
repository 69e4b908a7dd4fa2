#!/usr/bin/env bash
# One device call (about 7 minutes) for run 15, most valuable first, each part under its own time limit;
# everything lands in $OUT/results.tgz, re-packed after every step (scripts/gpu_steps.sh), so a call cut off
# at its limit keeps what finished.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session.sh
# Run 14 (BENCHMARKS.md "Fourteenth H200 run") found form 1's fixed ~33 us a launch in its first read of the
# 4-byte `fscale`: 44% of the 4k launch's stall samples wait there (long scoreboard), and MLX serves arrays of
# 8 bytes or less from one managed pool the host rewrites all the time (a page fault a launch). The launch's
# constants are now paged arrays of their own (cuda_kernels.PAGE_WORDS). So:
#   1. form 1's device time at 4k / 32k / 128k against run 13's 35.3 / 56.4-59.4 / 119.6-120.5 us, and the 4k
#      stall samples again (does the first load still wait?);
#   2. decode at 32k and 128k against mlx-lm (3 repeats);
#   3. the 128k prefill again (turbo's 0.58x in run 14 held 11 s of first-use checks inside its timed row).
# The whole suite is scripts/gpu_suite.sh (run it after this, its own call with .gpu/c).
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
python3 -c "import mlx.core as mx, mlx_lm; print('device', mx.default_device(), 'mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
step ab-contexts 75 env OUT="$RES" CONTEXTS="4096 32768 131072" VARIANTS="MLXKV_CUDA_MMA=1" bash scripts/gpu_kernel_ab.sh
step sections-4k 45 env OUT="$RES" CONTEXTS="4096" bash scripts/gpu_kernel_sections.sh
step bench 140 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill --repeats 3 --budget-s 125 \
  --only mlx-lm/bf16,mlxkv/affine:4/True,mlxkv/turbo:k4v3/True --output "$RES/h200-llama-8b-run15.json"
step prefill 150 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 131072 --repeats 1 --budget-s 145 \
  --output "$RES/h200-llama-8b-run15-prefill.json"
exit 0
