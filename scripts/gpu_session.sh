#!/usr/bin/env bash
# One device session (about 8 minutes): what a change to the decode kernel needs checked and timed on the
# GPU, most valuable first, each part under its own time limit.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session.sh
# 1. the kernel tests in both tensor-core forms (kernel == portable on this device), then the kernel against the
#    portable path end to end (scripts/gpu_kernel_e2e.py: KL per step over 1 000 decode steps of llama-1b);
# 2. scripts/gpu_kernel_ab.sh: the decode launch's device time per form and split target at 512, 32k and
#    128k tokens, then its MODE=stalls (why each form's warps wait) and
#    scripts/gpu_kernel_ablate.py (what each part of the body costs), at 32k;
# 3. scripts/host_step.py (host us per layer against mlx-lm's, real kernels);
# 4. scripts/gpu_bench.py at 512 and 32k (mlx-lm bf16 in the same run), in the form that was faster at 32k.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx, mlx_lm; print('device', mx.default_device(), 'mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__)"
step() { local name=$1 limit=$2; shift 2; echo "== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n 4 "$OUT/$name.log" | cut -c1-300
  echo "== $name rc=$rc in $((SECONDS - t0))s"; }
pytest_args=(-q -p no:cacheprovider -n 8 --timeout 60 -rfEs)
MLXKV_CUDA_MMA=2 step tests-staged 90 python3 -m pytest "${pytest_args[@]}" tests/test_cuda_mma.py tests/test_cuda_decode.py \
  tests/test_cuda_steady.py tests/test_paged.py
step tests-default 50 python3 -m pytest "${pytest_args[@]}" tests/test_cuda_decode.py
step e2e 60 python3 scripts/gpu_kernel_e2e.py --shape llama-1b --steps 1000
VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2 MLXKV_CUDA_MMA=1,MLXKV_CUDA_TARGET_BLOCKS=264 MLXKV_CUDA_MMA=2,MLXKV_CUDA_TARGET_BLOCKS=264" \
  CONTEXTS=32768 bash scripts/gpu_kernel_ab.sh | tee "$OUT/ab-32k.txt"
VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2" CONTEXTS="512 131072" bash scripts/gpu_kernel_ab.sh | tee "$OUT/ab-ends.txt"
MODE=stalls VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2" CONTEXTS=32768 bash scripts/gpu_kernel_ab.sh | tee "$OUT/stalls-32k.txt"
for f in 2 1; do timeout 60 python3 scripts/gpu_kernel_ablate.py --form $f --context 32768 2>&1 | tail -n 8; done
form=$(python3 - "$OUT/ab-32k.txt" <<'PY'
import re, sys
t = {m[0]: float(m[1]) for m in re.findall(r"^MLXKV_CUDA_MMA=(\d) ctx 32768: median ([\d.]+)", open(sys.argv[1]).read(), re.M)}
print(min(t, key=t.get) if t else "1")
PY
)
echo "== bench form $form"
export MLXKV_CUDA_MMA=$form
step host-step 40 python3 scripts/host_step.py --kinds mlx-lm,default,kernel,packed-kernel --repeats 3
step bench 170 python3 scripts/gpu_bench.py --contexts 512,32768 --no-prefill --repeats 2 --budget-s 100 \
  --output "$OUT/h200-llama-8b-next.json"
tail -n 16 "$OUT/bench.log"
# the device hands back at most 8 files: everything in one archive
tar czf /tmp/session.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/session.tgz "$OUT/"
exit 0
