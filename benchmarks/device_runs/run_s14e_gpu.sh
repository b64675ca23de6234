#!/usr/bin/env bash
# (KREP16 measured 37.7 against 38.1 us busy at 128K: within run-to-run noise; its code was reverted after this call,
# commit 2800b10 holds it.)
# Session 14, call 9 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the pair keys' table in 16
# copies (RQ_V5_DEFS=KREP16, opt-in; 384 threads still fit): kernels_check's quick v5 set with it, then CUPTI busy a
# layer at 128K and 32K, pair codebooks as shipped against KREP16 (fp16 and the scalar codebook beside them).
set -u
OUT=${OUT:-$PWD/s14e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== check KREP16 ($(date -u +%T))"
RQ_V5_DEFS=KREP16 timeout 100 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check_krep16.log" 2>&1
grep -E "FAIL|passed|/p128" "$OUT/check_krep16.log" | tail -12
for defs in "" KREP16; do
  echo "== busy defs=[$defs] ($(date -u +%T))"
  RQ_V5_DEFS=$defs timeout 90 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 \
    --methods "fp16,v5,v5pair" --out "$OUT/busy_{T}.json" > "$OUT/busy_$defs.log" 2>&1
  grep -E "^summary|Error" "$OUT/busy_$defs.log" | head -8; rm -f "$OUT"/busy_*.json
done
echo "== done ($(date -u +%T))"
