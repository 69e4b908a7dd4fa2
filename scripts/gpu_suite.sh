#!/usr/bin/env bash
# The whole test suite on the GPU machine (MLX's CUDA backend), 8 xdist workers, 180 s per test (kernel builds
# run 3-5x slower under 14 workers: run 11's calibrate fixture passed 120 s compiling five launches).
# From the repository root, after `source /var/tmp/mlxw/gpu-env.sh` (MLX CUDA + mlx-lm on PYTHONPATH) and, for
# the serve / constrain / fuzzing tests, `source .gpu/c/serve-env.sh` (scripts/stage-serve-wheels, its own call):
#   OUT=/some/folder bash scripts/gpu_suite.sh [extra pytest args]
# Writes $OUT/pytest-cuda.xml (junit) and $OUT/pytest-cuda.log; exits with pytest's status.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the junit XML and the log}"
mkdir -p "$OUT"
log="$OUT/pytest-cuda.log"
python3 - <<'EOF' > "$log" 2>&1 || { cat "$log"; exit 2; }
import mlx.core as mx, mlx_lm, transformers
assert mx.cuda.is_available(), "MLX CUDA backend missing: source /var/tmp/mlxw/gpu-env.sh first"
print(f"device {mx.default_device()} | mlx {mx.__version__} | mlx-lm {mlx_lm.__version__} | transformers {transformers.__version__}")
EOF
PYTHONUNBUFFERED=1 python3 -m pytest -q -n 8 --timeout 180 -p no:cacheprovider -p no:benchmark -rfEs \
  --durations=25 --junitxml "$OUT/pytest-cuda.xml" "$@" 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
