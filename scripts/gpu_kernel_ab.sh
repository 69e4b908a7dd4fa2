#!/usr/bin/env bash
# Decode-kernel A/B under ncu (about 15 s a case): device time of the steady decode launches for each
# variant (comma-separated environment settings) and context, one line each, with registers and grid.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder \
#     VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2,MLXKV_CUDA_STAGES=3" CONTEXTS="32768" bash scripts/gpu_kernel_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
KIND=${KIND:-affine4-kernel}
for variant in ${VARIANTS:-MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2}; do
  for ctx in ${CONTEXTS:-32768}; do
    tag=$(echo "$variant" | tr ',=' '-_')
    f="$OUT/ab-$KIND-$tag-$ctx.csv"
    env $(echo "$variant" | tr ',' ' ') timeout 90 $NCU --clock-control none \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size \
      --csv -k regex:mlxkv_decode python3 scripts/gpu_ncu_step.py --kind "$KIND" --context $ctx --layers 2 --steps 4 \
      > "$f" 2>/dev/null
    python3 - "$f" "$variant" "$ctx" <<'PY'
import csv, sys, statistics
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((r for r in rows if "Kernel Name" in r), None)
if hdr is None:
    print(f"{sys.argv[2]} ctx {sys.argv[3]}: no data"); raise SystemExit
data = [dict(zip(hdr, r)) for r in rows if len(r) == len(hdr) and r is not hdr]
SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
by = {}
for d in data:  # times in us, bytes in MB
    v = d["Metric Value"].replace(",", "")
    unit = d.get("Metric Unit", "")
    by.setdefault(d["ID"], {})[d["Metric Name"]] = float(v) * SCALE.get(unit, 1.0) if unit in SCALE else v
launches = list(by.values())[2:]  # the first two are the plan's first calls
t = [x["gpu__time_duration.sum"] for x in launches]
b = [x["dram__bytes_read.sum"] for x in launches]
regs = launches[-1].get("launch__registers_per_thread") if launches else "?"
grid = launches[-1].get("launch__grid_size") if launches else "?"
print(f"{sys.argv[2]} ctx {sys.argv[3]}: median {statistics.median(t):.1f} us over {len(t)} launches "
      f"(min {min(t):.1f}), {statistics.median(b):.1f} MB read, {statistics.median(b)/statistics.median(t):.2f} TB/s, "
      f"regs {regs}, grid {grid}")
PY
  done
done
exit 0
