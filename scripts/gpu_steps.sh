# Sourced by the device session scripts: `step NAME LIMIT CMD...` runs CMD under a time limit with its log in
# $RES (a scratch folder), prints the log's tail, then re-packs everything in $RES into $OUT/results.tgz, so
# a call cut off at its limit still hands back every step that finished (the device returns at most 8 files
# from $OUT, and none that a killed call never wrote).
: "${OUT:?set OUT to the folder for the results}"
RES=${RES:-/tmp/gpu-results}
rm -rf "$RES" && mkdir -p "$RES" "$OUT"
export PYTHONUNBUFFERED=1
pack() { tar czf "$OUT/.results.tgz" -C "$RES" . && mv "$OUT/.results.tgz" "$OUT/results.tgz"; }
step() {
  local name=$1 limit=$2; shift 2; echo "== $name (<= ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1; local rc=$?
  tail -n "${TAIL_LINES:-6}" "$RES/$name.log" | cut -c1-300
  echo "== $name rc=$rc in $((SECONDS - t0))s"; pack
}
