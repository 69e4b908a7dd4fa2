#!/usr/bin/env bash
# One device call (about 8 minutes) for what issues 14, 17 and 19 still need measured on the GPU, most valuable
# first, each part under its own time limit; results archived into one file (the device returns at most 8).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_issues.sh
# 1. issue 14, P3/P8: prefill peak under the memory model's plan at 32k and 128k, and 4-bit weights at 128k
#    under a 10 GiB budget (scripts/gpu_prefill_memory.py --p8);
# 2. issue 14: prefill speed against mlx-lm bf16 at 32k, 64k and 128k, affine:4 and turbo:k4v3, and at 128k a
#    delayed start and a window (scripts/gpu_bench.py, prefill cases only);
# 3. issue 17: packed against paged batch rows at 16 x 8k and uneven rows, 2 repeats (the CUDA default);
# 4. issue 19: tests/test_fit_peak.py on CUDA (fit's peak model against the measured peak).
# The whole suite with the serve wheels is a call of its own (scripts/stage-serve-wheels, then
# `source .gpu/c/serve-env.sh && OUT=... bash scripts/gpu_suite.sh`).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; echo "== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n 12 "$OUT/$name.log" | cut -c1-300
  echo "== $name rc=$rc in $((SECONDS - t0))s"; }
step prefill-memory 180 python3 scripts/gpu_prefill_memory.py --p8
step prefill-speed 170 python3 scripts/gpu_bench.py --contexts 1 --repeats 1 --budget-s 140 \
  --output "$OUT/h200-llama-8b-prefill.json"
step batch 120 python3 scripts/gpu_bench.py --contexts 8192,-8192 --no-prefill --repeats 2 --budget-s 100 \
  --output "$OUT/h200-llama-8b-batch.json"
step fit-peak 60 python3 -m pytest -q -p no:cacheprovider --timeout 60 -rfE tests/test_fit_peak.py
tar czf /tmp/issues.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/issues.tgz "$OUT/"
exit 0
