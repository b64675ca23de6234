#!/usr/bin/env bash
# Session 15, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the value table loads
# issued before the softmax (RQ_V5_DEFS=VH4 / VH8: the first 4 / 8 m-tiles' A fragments decoded right after the
# scores), the rescale without its branch (NOBR), and two score chains (RQ_V5_SACC=4), against the default, for both
# codebooks. kernels_check's quick v5 set with NOBR,VH8 first (pair cases included), then CUPTI busy a layer at 128K and
# 32K (64-layer chain), fp16 in the first run only; the default again at the end (run-to-run noise).
set -u
OUT=${OUT:-$PWD/s15a_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== check NOBR,VH8 ($(date -u +%T))"
RQ_V5_DEFS=NOBR,VH8 timeout 100 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check_nobr_vh8.log" 2>&1
grep -E "FAIL|passed" "$OUT/check_nobr_vh8.log" | tail -6
run() {  # name, defs, sacc, methods
  echo "== busy $1 ($(date -u +%T))"
  RQ_V5_DEFS=$2 RQ_V5_SACC=$3 timeout 80 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 \
    --reps 3 --methods "$4" --out "$OUT/busy_{T}.json" > "$OUT/busy_$1.log" 2>&1
  grep -E "^summary|Error" "$OUT/busy_$1.log" | head -8; rm -f "$OUT"/busy_*.json
}
run default "" 1 "fp16,v5,v5pair"
run VH4 VH4 1 "v5,v5pair"
run VH8 VH8 1 "v5,v5pair"
run NOBR NOBR 1 "v5,v5pair"
run NOBR_VH4 NOBR,VH4 1 "v5,v5pair"
run SACC4 "" 4 "v5,v5pair"
run default2 "" 1 "fp16,v5,v5pair"
echo "== done ($(date -u +%T))"
