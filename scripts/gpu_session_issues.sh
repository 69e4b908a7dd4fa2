#!/usr/bin/env bash
# One device call (about 9 minutes) for what issues 14 and 17 still need measured on the GPU, most valuable first,
# each part under its own time limit; results in $OUT/results.tgz, re-packed after each step.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_issues.sh
# 1. issue 17: the paged rows' kernel tests (forms 1 and 3 now look a tile's page up once, one tile ahead: main loop
#    841 -> 764 instructions on CPU's build), then packed against paged batch rows at 16 x 8k and uneven rows,
#    2 repeats (run 8: paged 0.84x of packed, so packed is the CUDA default); before that, the kernel alone at
#    16 x 8k with splits rounded up (shipped: 640 blocks, 1.2 waves) and down (MLXKV_CUDA_SPLIT_ROUND=down: 512);
# 2. issue 14: turbo's encode now compiled (18 nodes, was 63-70; CPU 2026-12-02): its tests on the device (compiled
#    = uncompiled bits), its pieces against affine:4 at 32k (scripts/bench_turbo_prefill.py), then
#    why turbo's prefill is slow, chunk by chunk (scripts/gpu_prefill_probe.py), then its prefill speed
#    against mlx-lm bf16 at 128k with affine:4, a delayed start and a window (scripts/gpu_bench.py, prefill only;
#    run 10: affine:4 1.05x, turbo:k4v3 0.44x).
# Done in run 10 and left out: the fit / conversion tests and P3/P8 (gpu_prefill_memory.py --p8). The whole suite
# with the serve wheels is a call of its own (scripts/stage-serve-wheels, then
# `source .gpu/c/serve-env.sh && OUT=... bash scripts/gpu_suite.sh`).
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
step tests-paged 60 python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 60 -rfE tests/test_paged.py \
  tests/test_cuda_decode.py
step ab-batch 60 env OUT="$RES" ROWS=16 CONTEXTS=8192 VARIANTS="MLXKV_CUDA_SPLIT_ROUND=up MLXKV_CUDA_SPLIT_ROUND=down" \
  bash scripts/gpu_kernel_ab.sh
step batch 110 python3 scripts/gpu_bench.py --contexts 8192,-8192 --no-prefill --repeats 2 --budget-s 90 \
  --output "$RES/h200-llama-8b-batch.json"
step turbo-tests 40 python3 -m pytest -q -p no:cacheprovider --timeout 30 -rfE tests/test_codec_turbo.py
step turbo-pieces 60 python3 scripts/bench_turbo_prefill.py --past 32768 --layer
step prefill-probe 80 python3 scripts/gpu_prefill_probe.py --context 32768
step prefill-speed 150 python3 scripts/gpu_bench.py --contexts 1 --prefill-contexts 131072 --repeats 1 --budget-s 130 \
  --output "$RES/h200-llama-8b-prefill.json"
exit 0
