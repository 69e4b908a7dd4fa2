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
variants=""
for tb in ${TBS:-528 1056 2112 4224}; do variants="$variants MLXKV_CUDA_TARGET_BLOCKS=$tb"; done
KIND="$KIND" VARIANTS="$variants" CONTEXTS="32768 131072" bash scripts/gpu_kernel_ab.sh
exit 0
