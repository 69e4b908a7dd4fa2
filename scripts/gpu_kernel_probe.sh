#!/usr/bin/env bash
# The decode kernel under ncu (about 4 minutes): full sections (occupancy, stalls, memory) of one
# steady launch at 512 and 32k tokens, then its time at 32k and 128k for several split targets.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_kernel_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
KIND=${KIND:-affine4-kernel}
for ctx in 512 32768; do
  timeout 120 $NCU --clock-control none --set full -k regex:mlxkv_decode --launch-skip 2 --launch-count 1 \
    python3 scripts/gpu_ncu_step.py --kind "$KIND" --context $ctx --layers 2 --steps 3 > "$OUT/full-$ctx.txt" 2>&1
  echo "== full $ctx rc=$?"; grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Memory Throughput|DRAM Throughput|Local|Warp Cycles Per Issued|Grid Size|Shared Memory Config|Dynamic Shared" "$OUT/full-$ctx.txt" | head -30
done
for tb in ${TBS:-528 1056 2112 4224}; do
  for ctx in 32768 131072; do
    MLXKV_CUDA_TARGET_BLOCKS=$tb timeout 90 $NCU --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
      -k regex:mlxkv_decode python3 scripts/gpu_ncu_step.py --kind "$KIND" --context $ctx --layers 2 --steps 3 > "$OUT/tb-$tb-$ctx.csv" 2>/dev/null
    python3 - "$OUT/tb-$tb-$ctx.csv" "$tb" "$ctx" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((r for r in rows if "Kernel Name" in r), None)
if hdr is None:
    print("no data", sys.argv[2:]); raise SystemExit
data = [dict(zip(hdr, r)) for r in rows if len(r) == len(hdr) and r is not hdr]
for d in data[-4:]:
    print("tb", sys.argv[2], "ctx", sys.argv[3], d["Kernel Name"][:32], d["Grid Size"], d["Metric Name"], d["Metric Value"])
PY
  done
done
exit 0
