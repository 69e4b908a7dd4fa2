#!/usr/bin/env bash
# One device call (about 6 minutes) for run 16, each part under its own time limit; everything lands in
# $OUT/results.tgz, re-packed after every step (scripts/gpu_steps.sh), so a call cut off at its limit keeps
# what finished.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session.sh
# Run 15 (BENCHMARKS.md "Fourteenth and fifteenth H200 runs") took the page fault out of form 1 (4k 35 -> 17 us,
# 128k 120 -> 105 us, 128k decode 0.94x) but its 32k decode ran on a slow machine (mlx-lm 124 tok/s, outside the
# band) and its 128k prefill rows still held first-use checks (the warm prompt did not reach cuda_min_tokens;
# now 10 240 tokens). So: 1. decode at 32k and 128k again (3 repeats); 2. the 64k and 128k prefill (issue 14's targets
# name both) with the longer warm prompt (turbo's rows should now carry no checks: issue 14's turbo >= 0.7x). Then, warm, its second call
# scripts/gpu_session_kernel.sh (where form 1's 128k launch and turbo's body lose bandwidth), then the suite.
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
python3 -c "import mlx.core as mx, mlx_lm; print('device', mx.default_device(), 'mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
step bench 140 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill --repeats 3 --budget-s 125 \
  --only mlx-lm/bf16,mlxkv/affine:4/True,mlxkv/turbo:k4v3/True --output "$RES/h200-llama-8b-run16.json"
step prefill 200 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 65536,131072 --repeats 1 --budget-s 195 \
  --output "$RES/h200-llama-8b-run16-prefill.json"
exit 0
