#!/usr/bin/env bash
# One device session (under 9.5 minutes): what a change to the decode kernel needs checked and timed on the
# GPU, most valuable first, each part under its own time limit; everything lands in $OUT/results.tgz,
# re-packed after every step (scripts/gpu_steps.sh), so a call cut off at its limit keeps what finished.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session.sh
# 1. scripts/gpu_kernel_ab.sh MODE=stalls at 32k: why each tensor-core form's warps wait;
# 2. the kernel tests in both forms (kernel == portable on this device), and the staged form end to end
#    (scripts/gpu_kernel_e2e.py: KL per step over 1 000 decode steps of llama-1b, <= 1e-4); the kernel tests
#    in form 3 (cuda_form3.py: form 2's keys-as-A arithmetic with form 1's loads, opt-in, first time on a GPU);
# 3. scripts/gpu_kernel_ab.sh at 32k and 128k (about 17 s a case, 12 cases): forms 1, 2 and 3 at the default
#    528 target blocks, form 2 at 264 (fewer splits: a cheaper merge), forms 2 and 3 at 5 blocks per SM with
#    660 (96 registers; 10 and 32 bytes spilled: scripts/cuda_compile_check.py);
# 4. scripts/gpu_bench.py at 32k (mlx-lm bf16 in the same run) in the variant with the smallest summed
#    minimum of step 3, within a 60 s budget; the whole bench (512 to 128k) is a call of its own.
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=8 source scripts/gpu_steps.sh
python3 -c "import mlx.core as mx, mlx_lm; print('device', mx.default_device(), 'mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
pytest_args=(-q -p no:cacheprovider -n 8 --timeout 60 -rfEs)
step stalls 60 env OUT="$RES" MODE=stalls VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2" CONTEXTS=32768 \
  bash scripts/gpu_kernel_ab.sh
step tests-staged 90 env MLXKV_CUDA_MMA=2 python3 -m pytest "${pytest_args[@]}" tests/test_cuda_mma.py \
  tests/test_cuda_decode.py tests/test_cuda_steady.py tests/test_paged.py
step tests-default 40 python3 -m pytest "${pytest_args[@]}" tests/test_cuda_decode.py
step e2e-staged 45 env MLXKV_CUDA_MMA=2 python3 scripts/gpu_kernel_e2e.py --shape llama-1b --steps 1000
step tests-form3 45 env MLXKV_CUDA_MMA=3 python3 -m pytest "${pytest_args[@]}" tests/test_cuda_mma.py \
  tests/test_cuda_decode.py
step ab 215 env OUT="$RES" CONTEXTS="32768 131072" VARIANTS="MLXKV_CUDA_MMA=1 \
MLXKV_CUDA_MMA=2 MLXKV_CUDA_MMA=2,MLXKV_CUDA_TARGET_BLOCKS=264 MLXKV_CUDA_MMA=2,MLXKV_CUDA_MIN_BLOCKS=5,MLXKV_CUDA_TARGET_BLOCKS=660 MLXKV_CUDA_MMA=3 \
MLXKV_CUDA_MMA=3,MLXKV_CUDA_MIN_BLOCKS=5,MLXKV_CUDA_TARGET_BLOCKS=660" \
  bash scripts/gpu_kernel_ab.sh
best=$(python3 - "$RES/ab.log" <<'PY'
import re, sys
mins = {}
for v, m in re.findall(r"^(\S+) ctx \d+: median [\d.]+ us over \d+ launches \(min ([\d.]+)\)", open(sys.argv[1]).read(), re.M):
    mins.setdefault(v, []).append(float(m))
full = {v: sum(t) for v, t in mins.items() if len(t) == 2}
print(min(full, key=full.get) if full else "MLXKV_CUDA_MMA=1")
PY
)
echo "== bench in $best"
step bench 80 env $(echo "$best" | tr ',' ' ') python3 scripts/gpu_bench.py --contexts 32768 --no-prefill \
  --repeats 2 --budget-s 60 --output "$RES/h200-llama-8b-next.json"
exit 0
