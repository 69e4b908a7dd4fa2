#!/usr/bin/env bash
# Run 19 (issue 13), two warm calls of about 4 and 5 minutes. The tensor-core bodies now index within a row in
# 32-bit ints from a 64-bit row base (cuda_compile_check: form 1's loop 718 -> 671 instructions, form 3's
# 695 -> 641, turbo's 951 -> 935, affine:8's 4-byte spill gone). PART=a: the kernel tests of the changed text
# (form 1, the default), then forms 1 / 2 / 3 under ncu at 32k and 128k and turbo's form 1 at 128k (run 16:
# form 1 36.3 / 105.7 us, form 2 35.9 / 95.8, turbo 120.0). PART=b: the decode bench at 32k and 128k (3
# repeats, mlx-lm bf16 in the same run) and the kernel tests once more under form 3.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder PART=a bash scripts/gpu_session_run19.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
tests=(tests/test_cuda_decode.py tests/test_cuda_steady.py tests/test_cuda_turbo_decode.py tests/test_cuda_stage.py)
pytest_cuda() { python3 -m pytest -q -n 8 --timeout 150 -p no:cacheprovider -p no:benchmark -rfE --tb=short "$@"; }
export -f pytest_cuda
if [ "${PART:-a}" = a ]; then
  step tests 230 bash -c "pytest_cuda ${tests[*]}"
  step forms 120 env OUT="$RES" CONTEXTS="32768 131072" \
    VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2 MLXKV_CUDA_MMA=3" bash scripts/gpu_kernel_ab.sh
  step turbo 40 env OUT="$RES" KIND=turbo-kernel CONTEXTS="131072" VARIANTS="MLXKV_CUDA_MMA=1" bash scripts/gpu_kernel_ab.sh
else
  step bench 160 python3 scripts/gpu_bench.py --contexts 32768,131072 --no-prefill --repeats 3 --budget-s 140 \
    --only mlx-lm/bf16,mlxkv/affine:4/True,mlxkv/turbo:k4v3/True --output "$RES/h200-llama-8b-run19.json"
  step tests-form3 200 env MLXKV_CUDA_MMA=3 bash -c "pytest_cuda tests/test_cuda_decode.py tests/test_cuda_steady.py"
fi
exit 0
