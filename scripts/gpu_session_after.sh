#!/usr/bin/env bash
# Run 13's second call (about 8 minutes), after scripts/gpu_session.sh: the whole suite on CUDA (serve's prefix
# cache now pins pages), then two probes that need no A/B:
# - scripts/gpu_qmm_transient.py: which 4-bit matmul holds P8's ~1 GB the plan does not name;
# - scripts/gpu_step_anatomy.py at 32k: whether affine:4's decode step (8.55 ms in run 12 against mlx-lm's 6.46,
#   ~2 ms more than its kernel and weights explain) is host-bound (build + encode close to the step) or not.
#   source /var/tmp/mlxw/gpu-env.sh && source .gpu/c/serve-env.sh && OUT=/some/folder bash scripts/gpu_session_after.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
bash scripts/gpu_suite.sh -n 14 > /dev/null 2>&1; echo "suite rc=$?"; tail -1 "$OUT/pytest-cuda.log"
timeout 60 python3 scripts/gpu_qmm_transient.py --rows 1,2048 > "$OUT/qmm-transient.jsonl" 2>&1; echo "qmm rc=$?"
grep '"dequantizes": true' "$OUT/qmm-transient.jsonl" | head -20
OUT="$OUT" timeout 120 python3 scripts/gpu_step_anatomy.py --contexts 32768 --steps 24 --kinds mlx-lm,full,affine4-kernel > "$OUT/step-anatomy.txt" 2>&1
echo "anatomy rc=$?"; tail -8 "$OUT/step-anatomy.txt"
# form 1 at 4k and 16k: with run 12's 32k and 128k (the same 520-block grid at both), how a launch's time splits
# into a fixed part and a per-token part (run 12's two points fit ~42 us fixed + ~20 us per 32k tokens)
OUT="$OUT" CONTEXTS="4096 16384" VARIANTS="MLXKV_CUDA_MMA=1" timeout 60 bash scripts/gpu_kernel_ab.sh 2>&1 | grep ctx
exit 0
