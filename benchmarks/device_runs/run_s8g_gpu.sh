#!/usr/bin/env bash
# Session 8, device call 12 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 300):
# where the new default's time goes. ncu stall sampling of attn_v5 (VDEC 2, 132 blocks) at 128K and 32K, one
# launch each (per-instruction samples: benchmarks/diag/sass_buckets.py splits them into prologue, loop and
# epilogue), then CUPTI busy time a layer in the chain (chain_timeline) at 32K and 128K.
set -u
OUT=${OUT:-$PWD/s8g_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for T in 131072 32768; do
  echo "== ncu $T ($(date -u +%T))"
  timeout 100 "$NCU" --clock-control none -k regex:attn_v5 --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section SourceCounters --section Occupancy \
    -o "$OUT/prof_$T" python3 benchmarks/kernel_time.py --contexts $T --reps 2 \
    --methods "v5 256" --v5-configs 256:2:132:1:2:2 > "$OUT/prof_$T.log" 2>&1; tail -1 "$OUT/prof_$T.log"
  "$NCU" --import "$OUT/prof_$T.ncu-rep" --page details > "$OUT/details_$T.txt" 2>&1
  "$NCU" --import "$OUT/prof_$T.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$T.csv" 2>&1
  grep -iE "duration|issued ipc|eligible|active warps|no eligible" "$OUT/details_$T.txt" | head -8
  python3 benchmarks/diag/sass_buckets.py "$OUT/sass_$T.csv" 2>&1 | tail -14
  rm -f "$OUT/prof_$T.ncu-rep" "$OUT/prof_$T.log"; gzip -f "$OUT/sass_$T.csv"
done
echo "== CUPTI busy a layer ($(date -u +%T))"
timeout 120 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 --methods "fp16,v5" \
  --out "$OUT/busy_{T}.json" > "$OUT/busy.log" 2>&1
grep "^summary" "$OUT/busy.log"
rm -f "$OUT"/busy_*.json
echo "== done ($(date -u +%T))"
