#!/usr/bin/env bash
# Run 17's call (about 6 minutes): where a steady 32k decode step goes now that form 1's fault is gone. Run 16's
# 32k decode: mlx-lm bf16 6.9 ms a step, affine:4 kernel 9.0 ms, turbo 11.4 ms, though form 1 at 32k is ~36 us
# a layer (1.2 ms a step) against cuDNN's SDPA's ~49 (run 6). So:
# 1. plain timings (scripts/gpu_trace_step.py): the model loop over each cache kind (host build, async_eval,
#    wait) and the engine's step, mlx-lm, affine:4 kernel, turbo:k4v3 kernel;
# 2. the device time of one step by kernel (ncu, one capture a case, scripts/ncu_step_summary.py);
# 3. form 2 (the staged body) against form 1 at 4k and 32k (run 16: 95.8 against 105.7 us at 128k).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_step.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=14 source scripts/gpu_steps.sh
export NCU=/usr/local/cuda/bin/ncu CTX=${CTX:-32768} RES
step plain 150 python3 scripts/gpu_trace_step.py --context "$CTX" --steps 32 \
  --cases model:mlx-lm,model:affine4-kernel,model:turbo-kernel,engine:affine4-kernel,engine:turbo-kernel
ncu_case() {  # case, its --steps, the steps that puts in the profiler range
  local f="$RES/ncu-$(echo "$1" | tr ':' '-').csv"
  timeout 80 $NCU --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/gpu_trace_step.py --cases "$1" --context "$CTX" --steps "$2" > "$f" 2>"$f.err"
  python3 scripts/ncu_step_summary.py "$f" --steps "$3" --label "$1 at $CTX"
}
export -f ncu_case  # a model case with --steps 1 runs 2 steps in the profiler range, an engine case with 2 runs 2
step ncu-mlx-lm 80 bash -c 'ncu_case model:mlx-lm 1 2'
step ncu-affine 80 bash -c 'ncu_case model:affine4-kernel 1 2'
step ncu-turbo 80 bash -c 'ncu_case model:turbo-kernel 1 2'
step ncu-engine-affine 80 bash -c 'ncu_case engine:affine4-kernel 2 2'
step form2 100 env OUT="$RES" CONTEXTS="4096 32768" VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2" bash scripts/gpu_kernel_ab.sh
exit 0
