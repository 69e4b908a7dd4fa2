#!/usr/bin/env bash
# Where a steady decode step goes on the device (about 5 minutes): plain timings of the model and
# engine cases of scripts/gpu_trace_step.py, then the same cases under nsys (a timeline: kernels,
# CUDA API calls that block the host, managed-memory faults) or, without nsys, ncu (kernel times).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder CONTEXT=512 bash scripts/gpu_trace.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CONTEXT=${CONTEXT:-512}
CASES=${CASES:-model:mlx-lm,model:full,model:affine4-kernel,engine:full,engine:affine4-kernel}
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda/nsight-systems*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}"
echo "== plain"
timeout 150 python3 scripts/gpu_trace_step.py --cases "$CASES" --context "$CONTEXT" --steps 32 2>&1 | tee "$OUT/plain.log" | grep '^{'
echo "== cprofile"
timeout 90 python3 scripts/gpu_trace_step.py --cases engine:affine4-kernel --context "$CONTEXT" --steps 32 --cprofile \
  > "$OUT/cprofile.log" 2>&1; head -c 6000 "$OUT/cprofile.log"
if [ -n "$NSYS" ]; then
  echo "== nsys"
  timeout 200 "$NSYS" profile --capture-range=cudaProfilerApi --capture-range-end=repeat -t cuda,osrt \
    --cuda-um-cpu-page-faults=true --cuda-um-gpu-page-faults=true -f true -o "$OUT/trace" \
    python3 scripts/gpu_trace_step.py --cases "$CASES" --context "$CONTEXT" --steps 12 > "$OUT/nsys.log" 2>&1
  echo "nsys rc=$?"; tail -5 "$OUT/nsys.log"
  for f in "$OUT"/trace*.nsys-rep; do
    b=${f%.nsys-rep}
    timeout 60 "$NSYS" stats -q -r cuda_api_sum,cuda_gpu_kern_sum,cuda_gpu_mem_time_sum,um_sum -f csv -o "$b" "$f" >/dev/null 2>&1
    echo "== $(basename "$b")"; for r in "$b"_cuda_api_sum.csv "$b"_cuda_gpu_kern_sum.csv "$b"_cuda_gpu_mem_time_sum.csv; do
      [ -f "$r" ] && head -12 "$r" | cut -c1-200; done
  done
  rm -f "$OUT"/trace*.sqlite
else
  echo "== ncu"
  timeout 200 /usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/gpu_trace_step.py --cases model:mlx-lm,model:affine4-kernel --context "$CONTEXT" --steps 2 > "$OUT/ncu.csv" 2>"$OUT/ncu.err"
  echo "ncu rc=$?"; tail -3 "$OUT/ncu.err"
fi
exit 0
