#!/usr/bin/env bash
# One device session (under 9.5 minutes): what a change to the decode kernel needs checked and timed on the
# GPU, most valuable first, each part under its own time limit; everything lands in $OUT/results.tgz,
# re-packed after every step (scripts/gpu_steps.sh), so a call cut off at its limit keeps what finished.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session.sh
# 1. the kernel tests with the split counter's release arrival (MLXKV_CUDA_ARRIVE=release: CUTLASS's semaphore
#    in place of every warp's __threadfence, which ncu's source counters put at 31% of form 1's stall samples at
#    32k, run 10) in forms 1 and 3, then end to end (scripts/gpu_kernel_e2e.py: KL per step over 1 000 decode
#    steps of llama-1b, <= 1e-4);
# 2. scripts/gpu_kernel_ab.sh at 512, 32k and 128k (about 19 s a case, 12 cases): form 1 as shipped, forms 1 and 3
#    with the release arrival, and form 1 with it and at least 16 tiles a split (MLXKV_CUDA_SPLIT_TILES: 264
#    target blocks won at 32k and lost at 128k in run 10);
# 3. ncu's source counters of the release arrival at 32k, caches warm (scripts/gpu_kernel_sections.sh CACHE=none):
#    where the stalls went;
# 4. scripts/gpu_bench.py at 32k (mlx-lm bf16 in the same run) in the variant with the smallest summed
#    minimum of step 2, within a 60 s budget; the whole bench (512 to 128k) is a call of its own.
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=8 source scripts/gpu_steps.sh
python3 -c "import mlx.core as mx, mlx_lm; print('device', mx.default_device(), 'mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
pytest_args=(-q -p no:cacheprovider -n 8 --timeout 60 -rfEs)
kernel_tests=(tests/test_cuda_mma.py tests/test_cuda_decode.py tests/test_cuda_steady.py)
step tests-release 70 env MLXKV_CUDA_ARRIVE=release python3 -m pytest "${pytest_args[@]}" "${kernel_tests[@]}"
step tests-release-form3 40 env MLXKV_CUDA_ARRIVE=release MLXKV_CUDA_MMA=3 python3 -m pytest "${pytest_args[@]}" \
  tests/test_cuda_mma.py tests/test_cuda_decode.py
step e2e-release 45 env MLXKV_CUDA_ARRIVE=release python3 scripts/gpu_kernel_e2e.py --shape llama-1b --steps 1000
step ab 245 env OUT="$RES" CONTEXTS="512 32768 131072" VARIANTS="MLXKV_CUDA_MMA=1 \
MLXKV_CUDA_MMA=1,MLXKV_CUDA_ARRIVE=release MLXKV_CUDA_MMA=1,MLXKV_CUDA_ARRIVE=release,MLXKV_CUDA_SPLIT_TILES=16 \
MLXKV_CUDA_MMA=3,MLXKV_CUDA_ARRIVE=release" bash scripts/gpu_kernel_ab.sh
step sections 45 env OUT="$RES" CONTEXTS=32768 CACHE=none VARIANT=MLXKV_CUDA_ARRIVE=release bash scripts/gpu_kernel_sections.sh
best=$(python3 - "$RES/ab.log" <<'PY'
import re, sys
mins = {}
for v, m in re.findall(r"^(\S+) ctx \d+: median [\d.]+ us over \d+ launches \(min ([\d.]+)\)", open(sys.argv[1]).read(), re.M):
    mins.setdefault(v, []).append(float(m))
full = {v: sum(t) for v, t in mins.items() if len(t) == 3}
print(min(full, key=full.get) if full else "MLXKV_CUDA_MMA=1")
PY
)
echo "== bench in $best"
step bench 80 env $(echo "$best" | tr ',' ' ') python3 scripts/gpu_bench.py --contexts 32768 --no-prefill \
  --repeats 2 --budget-s 60 --output "$RES/h200-llama-8b-next.json"
exit 0
