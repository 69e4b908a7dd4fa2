#!/usr/bin/env bash
# Run 18's call (about 8 minutes): a turbo step's launch takes the float32 rotated query as it is and hands its
# float32 output to the inverse rotation (cuda_decode._rotated_launch: two launches a layer fewer). Run 17 put
# turbo:k4v3's 32k step at 8.11 ms (model loop) / 11.09 ms (engine) against affine:4's 5.79 / 5.65. So:
# 1. the CUDA tests of the changed paths (the real turbo kernel from its recipe, bf16 and f32; plan checks);
# 2. plain timings at 32k (scripts/gpu_trace_step.py) and turbo's step by kernel under ncu;
# 3. the decode bench at 32k and 128k (mlx-lm bf16, affine:4, turbo:k4v3; 3 repeats).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_turbo_step.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=14 source scripts/gpu_steps.sh
export NCU=/usr/local/cuda/bin/ncu CTX=${CTX:-32768} RES
step tests 170 python3 -m pytest -q -n 8 --timeout 160 -p no:cacheprovider -p no:benchmark -rfEs -x \
  tests/test_cuda_steady.py tests/test_cuda_turbo_mma.py tests/test_cuda_turbo_decode.py tests/test_cuda_decode.py \
  tests/test_engine_sync.py
step plain 120 python3 scripts/gpu_trace_step.py --context "$CTX" --steps 32 \
  --cases model:mlx-lm,model:turbo-kernel,engine:turbo-kernel,engine:affine4-kernel
f="$RES/ncu-model-turbo-kernel.csv"
step ncu-turbo 80 bash -c "timeout 75 $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
  --csv python3 scripts/gpu_trace_step.py --cases model:turbo-kernel --context $CTX --steps 1 > $f 2>$f.err; \
  python3 scripts/ncu_step_summary.py $f --steps 2 --top 20 --label 'model:turbo-kernel at $CTX'"
step bench 150 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill --repeats 3 --budget-s 135 \
  --only mlx-lm/bf16,mlxkv/affine:4/True,mlxkv/turbo:k4v3/True --output "$RES/h200-llama-8b-run18.json"
exit 0
