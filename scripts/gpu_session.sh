#!/usr/bin/env bash
# One device session (about 9 minutes; the model build and warm-up alone take ~50 s): what a change to the decode path needs checked and
# timed on the GPU, most valuable first, each part under its own time limit.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session.sh
# 1. the kernel and joint-storage tests (kernel == portable on this device), the recipes' real-kernel test;
#    then scripts/host_step.py (host us per layer: update + attention, against mlx-lm's, real kernels) and
#    scripts/gpu_step_anatomy.py (host build / host encode / wall of a whole model's step);
# 2. scripts/gpu_bench.py at 512 and 32k (mlx-lm bf16 in the same run; kernel rows forced);
# 3. scripts/gpu_profile_step.py (32 attention layers, no weights) at 512, 8k and 32k;
# 4. the tests that failed on CUDA before (BENCHMARKS: the CUDA suite).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx, mlx_lm; print('device', mx.default_device(), 'mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
step() { local name=$1 limit=$2; shift 2; echo "== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n 25 "$OUT/$name.log"
  echo "== $name rc=$rc in $((SECONDS - t0))s"; }
pytest_args=(-q -p no:cacheprovider -n 4 --timeout 60 -rfEs)
step kernel-tests 140 python3 -m pytest "${pytest_args[@]}" tests/test_cuda_encode.py tests/test_joint_storage.py \
  tests/test_cuda_decode.py tests/test_cuda_steady.py tests/test_paged.py tests/test_prefill_bound.py
step host-step 30 python3 scripts/host_step.py --kinds mlx-lm,default,portable,kernel,packed-kernel,packed-portable \
  --repeats 3
step anatomy 100 python3 scripts/gpu_step_anatomy.py --contexts 512,32768
step bench 185 python3 scripts/gpu_bench.py --contexts 512,32768 --no-prefill --repeats 3 --budget-s 140 \
  --output "$OUT/h200-llama-8b-run4.json"
step profile 45 python3 scripts/gpu_profile_step.py --contexts 512,8192,32768 --steps 32 \
  --kinds mlx-lm,affine4-update,affine4,affine4-kernel
step cuda-tests 40 python3 -m pytest "${pytest_args[@]}" -n 8 tests/test_attention_blockwise.py tests/test_blas.py \
  tests/test_blas_default.py tests/test_bench_report.py tests/test_fixtures.py tests/test_prefill_memory.py \
  tests/test_serve_limits.py tests/test_gen_chat_cli.py "tests/test_generate.py::test_bits_off_equals_mlx_lm"
exit 0
