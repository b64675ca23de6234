#!/usr/bin/env bash
# Session 11, call 5 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): what holds the last
# block's first (m, l) loads ~2.4 us (call 3's stamps; halving the partials' bytes in call 4 made it longer, so not
# bandwidth): A/B without the partials' first round ahead of the weights (NOOV), the inverse rotation's blocks
# loaded after the weights (NOMI), both; then the quick v5 set with both.
set -u
OUT=${OUT:-$PWD/s11e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
for defs in "" NOOV NOMI NOOV,NOMI; do v5_variant "$defs" 1; done
grep -H "(m, l) in" "$OUT"/trace_*.txt
echo "== correctness, quick ($(date -u +%T))"
RQ_V5_DEFS=NOOV,NOMI timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
echo "== done ($(date -u +%T))"
