#!/usr/bin/env bash
# Decode-kernel A/B under ncu, one line per variant (comma-separated environment settings) and context:
#   MODE=time (default, about 17 s a case): device time of the steady decode launches, MB read, registers, grid;
#   MODE=stalls (about 20 s a case): ncu's stall reasons of one steady launch (warp cycles per issued
#   instruction spent in each), largest first.
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder \
#     VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2,MLXKV_CUDA_STAGES=3" CONTEXTS="32768" [MODE=stalls] [ROWS=16] bash scripts/gpu_kernel_ab.sh
# (ROWS: batch rows of CONTEXTS tokens each, packed as the engine merges them)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
KIND=${KIND:-affine4-kernel}
MODE=${MODE:-time}
if [ "$MODE" = stalls ]; then
  metrics=smsp__inst_executed.sum,smsp__average_warp_latency_per_inst_issued.ratio
  for r in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle \
           membar mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait; do
    metrics="$metrics,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  launches=(--launch-skip 2 --launch-count 1) steps=3
else
  metrics=gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__grid_size
  launches=() steps=8  # 16 launches, 14 timed: medians moved 1.6x between identical 8-launch cases
fi
for variant in ${VARIANTS:-MLXKV_CUDA_MMA=1 MLXKV_CUDA_MMA=2}; do
  for ctx in ${CONTEXTS:-32768}; do
    label=$ctx; [ "${ROWS:-1}" -gt 1 ] && label="${ROWS}x$ctx"
    f="$OUT/$MODE-$KIND-$(echo "$variant" | tr ',=' '-_')-$label.csv"
    env $(echo "$variant" | tr ',' ' ') timeout 90 $NCU --clock-control none --metrics "$metrics" --csv \
      -k regex:mlxkv_decode "${launches[@]}" \
      python3 scripts/gpu_ncu_step.py --kind "$KIND" --context $ctx --layers 2 --steps $steps --rows "${ROWS:-1}" > "$f" 2>/dev/null
    python3 - "$f" "$variant" "$label" "$MODE" <<'PY'
import csv, statistics, sys
path, variant, ctx, mode = sys.argv[1:]
rows = list(csv.reader(open(path)))
hdr = next((r for r in rows if "Metric Name" in r), None)
if hdr is None:
    print(f"{variant} ctx {ctx}: no data"); raise SystemExit
SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "byte": 1e-6,
         "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
by = {}
for r in rows:  # per launch: times in us, bytes in MB
    if len(r) == len(hdr) and r is not hdr:
        d = dict(zip(hdr, r))
        v, unit = d["Metric Value"].replace(",", ""), d.get("Metric Unit", "")
        try:
            by.setdefault(d["ID"], {})[d["Metric Name"]] = float(v) * SCALE.get(unit, 1.0)
        except ValueError:
            by.setdefault(d["ID"], {})[d["Metric Name"]] = v
if mode == "stalls":
    vals = next(iter(by.values()))
    stalls = {k.split("stalled_")[1].split("_per_issue")[0]: v for k, v in vals.items() if "stalled_" in k}
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:8]
    print(f"{variant} ctx {ctx}: {vals.get('smsp__inst_executed.sum', 0):.0f} warp instructions, "
          + ", ".join(f"{k} {v:.2f}" for k, v in top))
    raise SystemExit
launches = list(by.values())[2:]  # the first two are the plan's first calls
t = [x["gpu__time_duration.sum"] for x in launches]
b = [x["dram__bytes_read.sum"] for x in launches]
regs = int(launches[-1].get("launch__registers_per_thread", 0)) if launches else "?"
grid = int(launches[-1].get("launch__grid_size", 0)) if launches else "?"
print(f"{variant} ctx {ctx}: median {statistics.median(t):.1f} us over {len(t)} launches "
      f"(min {min(t):.1f}), {statistics.median(b):.1f} MB read, {statistics.median(b)/statistics.median(t):.2f} TB/s, "
      f"regs {regs}, grid {grid}")
PY
  done
done
exit 0
