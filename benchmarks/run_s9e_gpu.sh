#!/usr/bin/env bash
# Session 9, round 3 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590): the query row
# requested first and the last block's one-pass merge of the splits. Correctness (kernels_check v5, all cases; the
# cache's paths), the phase trace, ncu kernel-alone beside fp16 SDPA, CUPTI busy a layer, then the peers' table.
set -u
OUT=${OUT:-$PWD/s9e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== correctness ($(date -u +%T))"
timeout 150 python3 benchmarks/kernels_check.py --only v5 --v5-configs 256:1:1:2:2 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
for a in "5000 32 wht_so4" "40000 32 wht_so4" "5000 0 rwht_so4"; do
  set -- $a
  RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context $1 --window $2 --rotation $3 \
    --steps 3 > "$OUT/cache_$1_$2_$3.log" 2>&1; echo "cache $a: $(tail -1 "$OUT/cache_$1_$2_$3.log")"
done
cat "$OUT"/cache_*.log > "$OUT/cache.log"; rm -f "$OUT"/cache_*.log
echo "== trace ($(date -u +%T))"
timeout 100 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 5 > "$OUT/trace.txt" 2>&1
grep -v Warning "$OUT/trace.txt" | tail -42
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
echo "== ncu ($(date -u +%T))"
timeout 100 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
  --log-file "$OUT/ncu.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
  --methods "fp16 SDPA,v5 256" --v5-configs 256:2:132:1:2:2 \
  --schedule "$OUT/schedule.json" > "$OUT/kt.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu.csv" --schedule "$OUT/schedule.json" 2>&1 | tail -8; rm -f "$OUT/kt.log"
echo "== CUPTI busy a layer ($(date -u +%T))"
timeout 100 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 --methods "fp16,v5" \
  --out "$OUT/busy_{T}.json" > "$OUT/busy.log" 2>&1
grep "^summary" "$OUT/busy.log"
rm -f "$OUT"/busy_*.json
echo "== table ($(date -u +%T))"
mkdir -p "$OUT/table"
timeout 200 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 5 --chain --pipeline 4 \
  --contexts 4096,32768,131072 \
  --methods "=fp16 SDPA,=qmm 8-bit,=qmm 4-bit,=TurboQuant-3 (dense),=IsoQuant-3 four-kernel,=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch)" \
  --out "$OUT/table" > "$OUT/table.log" 2>&1
grep -E "^\||FAILED|Error" "$OUT/table.log"
echo "== done ($(date -u +%T))"
