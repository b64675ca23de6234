#!/usr/bin/env bash
# Session 10, call 3 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the fixed-cost set
# (RQ_V5_DEFS=ACQREL,PRELOAD,NPRE: acq_rel split counter, query loads first, the last block's partial loads in
# rounds of 17 with the first round before the weights) against the default: phase trace and ncu kernel-alone
# for each, CUPTI busy a layer in the 64-layer chain for each (fp16 beside it in both processes), every v5
# correctness check with the set, then ncu's per-instruction stall sampling of the set at 128K (the main loop).
# (Its per-variant step moved to gpu_steps.sh's v5_variant after the call ran: the same commands.)
set -u
OUT=${OUT:-$PWD/s10c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
NEW=ACQREL,PRELOAD,NPRE
for defs in "" $NEW; do
  v5_variant "$defs"
  tag=${defs:-base}; tag=${tag//,/_}
  echo "== CUPTI busy $tag ($(date -u +%T))"
  RQ_V5_DEFS=$defs timeout 100 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 \
    --methods "fp16,v5" --out "$OUT/busy_{T}.json" > "$OUT/busy_$tag.log" 2>&1
  grep "^summary" "$OUT/busy_$tag.log"; rm -f "$OUT"/busy_*.json
done
export RQ_V5_DEFS=$NEW
v5_correctness
echo "== ncu stall sampling 131072 ($(date -u +%T))"
timeout 100 "$NCU" --clock-control none -k regex:attn_v5 --launch-skip 1 --launch-count 1 \
  --section WarpStateStats --section SchedulerStats --section SourceCounters \
  -o "$OUT/prof" python3 benchmarks/kernel_time.py --contexts 131072 --reps 2 \
  --methods "v5 256" --v5-configs 256:2:132:1:2:2 > "$OUT/prof.log" 2>&1; tail -1 "$OUT/prof.log"
"$NCU" --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1
python3 benchmarks/diag/sass_buckets.py "$OUT/sass.csv" 2>&1 | tail -14
rm -f "$OUT/prof.ncu-rep" "$OUT/prof.log"; gzip -f "$OUT/sass.csv"
echo "== done ($(date -u +%T))"
