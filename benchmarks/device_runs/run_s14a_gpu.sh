#!/usr/bin/env bash
# Session 14, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin):
# the pair cases as shipped (head dim 64 among them, its test buffer now aligned), then the same with the keys'
# table lane-replicated (RQ_V5_DEFS=KREP: 16 KB on a 16 KB boundary, 256 threads), then CUPTI busy a layer at
# 128K and 32K: fp16, the scalar default, pair as shipped, pair with KREP.
set -u
OUT=${OUT:-$PWD/s14a_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for defs in "" KREP; do
  echo "== check defs=[$defs] ($(date -u +%T))"
  RQ_V5_DEFS=$defs timeout 90 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check_$defs.log" 2>&1
  grep -E "FAIL|passed|/p128" "$OUT/check_$defs.log" | tail -14
done
for defs in "" KREP; do
  echo "== busy defs=[$defs] ($(date -u +%T))"
  RQ_V5_DEFS=$defs timeout 90 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 \
    --methods "fp16,v5,v5pair" --out "$OUT/busy_{T}.json" > "$OUT/busy_$defs.log" 2>&1
  grep -E "^summary|Error" "$OUT/busy_$defs.log" | head -8; rm -f "$OUT"/busy_*.json
done
echo "== done ($(date -u +%T))"
