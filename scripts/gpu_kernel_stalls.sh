#!/usr/bin/env bash
# Why the decode kernel's warps wait (about 20 s a case): ncu's stall reasons of one steady launch (warp cycles
# per issued instruction spent in each), largest first, for each variant (comma-separated environment settings).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2" \
#     CONTEXTS="32768" bash scripts/gpu_kernel_stalls.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
KIND=${KIND:-affine4-kernel}
reasons="barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle membar
  mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait"
metrics=smsp__inst_executed.sum,smsp__average_warp_latency_per_inst_issued.ratio
for r in $reasons; do metrics="$metrics,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
for variant in ${VARIANTS:-MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2}; do
  for ctx in ${CONTEXTS:-32768}; do
    f="$OUT/stalls-$KIND-$(echo "$variant" | tr ',=' '-_')-$ctx.csv"
    env $(echo "$variant" | tr ',' ' ') timeout 90 $NCU --clock-control none --metrics "$metrics" --csv \
      -k regex:mlxkv_decode --launch-skip 2 --launch-count 1 \
      python3 scripts/gpu_ncu_step.py --kind "$KIND" --context $ctx --layers 2 --steps 3 > "$f" 2>/dev/null
    python3 - "$f" "$variant" "$ctx" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((r for r in rows if "Metric Name" in r), None)
if hdr is None:
    print(f"{sys.argv[2]} ctx {sys.argv[3]}: no data"); raise SystemExit
vals = {}
for r in rows:
    if len(r) == len(hdr) and r is not hdr:
        d = dict(zip(hdr, r))
        try:
            vals[d["Metric Name"]] = float(d["Metric Value"].replace(",", ""))
        except ValueError:
            pass
stalls = {k.split("stalled_")[1].split("_per_issue")[0]: v for k, v in vals.items() if "stalled_" in k}
top = sorted(stalls.items(), key=lambda kv: -kv[1])[:8]
print(f"{sys.argv[2]} ctx {sys.argv[3]}: {vals.get('smsp__inst_executed.sum', 0):.0f} warp instructions, "
      + ", ".join(f"{k} {v:.2f}" for k, v in top))
PY
  done
done
exit 0
