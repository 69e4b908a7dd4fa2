#!/usr/bin/env bash
# The next call after run 20d (about 6 minutes): full-precision batch decode with the query heads folded into the
# query length (attention/dense_fold.py) against MLX's one-query kernel: the call alone, then the engine's 16 x 8k
# step with the fold (MLXKV_DENSE_FOLD=1, opt-in on CUDA until this A/B) and without (its `peak_jumps` also say which
# step raised full precision's 43 GB peak); then P8's 128k case chunk by chunk (run 20d's 90 s were too few).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_run20e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=8 source scripts/gpu_steps.sh
step micro 50 python3 scripts/gpu_sdpa_fold.py
step engine-fold 60 env MLXKV_DENSE_FOLD=1 python3 scripts/gpu_trace_step.py --context 8192 --rows 16 --steps 24 --cases engine:full
step engine-nofold 60 env MLXKV_DENSE_FOLD=0 python3 scripts/gpu_trace_step.py --context 8192 --rows 16 --steps 24 \
  --cases engine:full
step p8-trace 220 python3 scripts/gpu_prefill_memory.py --p8-only --contexts 131072 --trace
exit 0
