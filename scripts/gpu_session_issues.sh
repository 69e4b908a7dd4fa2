#!/usr/bin/env bash
# One device call (about 8 minutes) for what issues 14, 17 and 19 still need measured on the GPU, most valuable
# first, each part under its own time limit; results in $OUT/results.tgz, re-packed after each step.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_issues.sh
# 0. issue 13, P0: the engine's per-step tax at 512 tokens (scripts/gpu_trace_step.py: the model loop against the
#    Engine, host profile of the engine's steps);
#    issue 19: tests/test_fit_peak.py on CUDA (scripts/gpu_fit_peak_probe.py says what fit's peak model misses);
# 1. issue 14, P3/P8: prefill peak under the memory model's plan at 32k and 128k, and 4-bit weights at 32k and
#    128k under a 10 GiB budget (scripts/gpu_prefill_memory.py --p8); then why turbo's prefill is slow
#    (scripts/gpu_prefill_probe.py: chunk by chunk, twice, and under the engine's plan);
# 2. issue 14: prefill speed against mlx-lm bf16 at 128k, affine:4 and turbo:k4v3, a delayed start and a window
#    (scripts/gpu_bench.py, prefill cases only; run 8 has 32k and 64k).
# The whole suite with the serve wheels is a call of its own (scripts/stage-serve-wheels, then
# `source .gpu/c/serve-env.sh && OUT=... bash scripts/gpu_suite.sh`).
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
step engine-tax 70 python3 scripts/gpu_trace_step.py --context 512 --steps 64 --cprofile \
  --cases model:mlx-lm,model:full,engine:full,engine:affine4-kernel
step fit-peak 60 python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfE tests/test_fit_peak.py tests/test_conversion.py
step prefill-memory 170 python3 scripts/gpu_prefill_memory.py --p8
step prefill-probe 80 python3 scripts/gpu_prefill_probe.py --context 32768
step prefill-speed 130 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 131072 --repeats 1 --budget-s 110 \
  --output "$RES/h200-llama-8b-prefill.json"
exit 0
