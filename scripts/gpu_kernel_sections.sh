#!/usr/bin/env bash
# ncu's detailed sections for one steady decode launch (what the kernel waits on, instruction by instruction):
# memory workload tables (sectors per request, L1/L2 hit rates), scheduler and warp-state statistics,
# occupancy, and the per-SASS-instruction stall samples (source counters), for each context; about 35 s a case.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder [CONTEXTS="32768 131072"] [VARIANT=MLXKV_CUDA_MMA=1] \
#     bash scripts/gpu_kernel_sections.sh
# Writes $OUT/sections-CTX-details.csv and $OUT/sections-CTX-sass.csv (each instruction with its samples).
# CACHE=none keeps the caches warm between ncu's replays, as a real step finds the queries (just written) in L2;
# the default (all: flushed) read 20% of form 1's samples at 32k as waits on the queries' loads (run 10).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
          --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats
          --section SourceCounters --section InstructionStats)
for ctx in ${CONTEXTS:-32768 131072}; do
  rep="/tmp/sections-$ctx"
  env ${VARIANT:-MLXKV_CUDA_MMA=1} timeout 120 $NCU --clock-control none --cache-control "${CACHE:-all}" "${sections[@]}" \
    -k regex:mlxkv_decode \
    --launch-skip 2 --launch-count 1 -f -o "$rep" \
    python3 scripts/gpu_ncu_step.py --kind "${KIND:-affine4-kernel}" --context "$ctx" --layers 2 --steps 3 \
    > "$OUT/sections-$ctx.log" 2>&1
  $NCU -i "$rep.ncu-rep" --page details --csv > "$OUT/sections-$ctx-details.csv" 2>&1
  $NCU -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/sections-$ctx-sass.csv" 2>&1
  echo "ctx $ctx: $(wc -l < "$OUT/sections-$ctx-details.csv") detail lines, $(wc -l < "$OUT/sections-$ctx-sass.csv") sass lines"
  grep -E '"(Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|L1/TEX Hit Rate|L2 Hit Rate|Mem Busy|Max Bandwidth|Eligible Warps Per Scheduler|Warp Cycles Per Issued Instruction)"' \
    "$OUT/sections-$ctx-details.csv" | cut -d, -f13-16 | head -20
  python3 scripts/ncu_stalls.py "$OUT/sections-$ctx-sass.csv" --top 6 2>&1 | cut -c1-200
done
