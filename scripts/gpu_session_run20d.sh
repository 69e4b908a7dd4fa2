#!/usr/bin/env bash
# Run 20's fourth call (about 8 minutes): where a 16-row decode step goes (issue 13's P0 16 x 8k full >= 2 000
# tok/s, P5 affine:4 >= 2 000: last measured 549 and 1 106 in run 9, ~29 and ~14.5 ms a step against ~8 and ~5 ms
# of weights and KV bytes). 1. the engine's step and mlx-lm's loop alone on the engine's merged caches (is it the
# engine or the model step?), 2. the device time of one engine step by kernel (ncu), 3. the bench rows with the
# peak counted once (the bench's list iterator kept every row's own caches alive: runs 5-9 counted the KV twice);
# P8's 128k case chunk by chunk (held and peak memory above the weights after each chunk: the ~1 GB over the plan).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_run20d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=8 source scripts/gpu_steps.sh
NCU=/usr/local/cuda/bin/ncu
step plain 110 python3 scripts/gpu_trace_step.py --context 8192 --rows 16 --steps 24 \
  --cases engine:full,engine:affine4-kernel
for kind in full affine4-kernel; do
  step "ncu-$kind" 100 "$NCU" --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/gpu_trace_step.py --context 8192 --rows 16 --steps 2 --cases "engine:$kind"
  python3 scripts/ncu_step_summary.py "$RES/ncu-$kind.log" --steps 2 --top 16 --label "16 x 8k engine:$kind" \
    | tee "$RES/ncu-$kind-summary.txt"; pack
done
step p8-trace 90 python3 scripts/gpu_prefill_memory.py --p8-only --contexts 131072 --trace
step bench16 100 python3 scripts/gpu_bench.py --contexts 8192,-8192 --no-prefill --repeats 1 --budget-s 80 \
  --only mlxkv/full/False,mlxkv/affine:4/True --output "$RES/h200-llama-8b-run20d.json"
exit 0
