#!/usr/bin/env bash
# Session 11, call 6 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the inverse rotation's
# SO(4) blocks kept in registers from the query's rotation (the default now) against loading them in the last
# block (MILOAD, as before; call 5: those 16 scalar loads a lane held the merge's first loads ~1 us): trace + ncu;
# the quick v5 set, the windowed and rwht_so4 cache checks; CUPTI busy against fp16.
set -u
OUT=${OUT:-$PWD/s11f_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
for defs in "" MILOAD; do v5_variant "$defs" 1; done
grep -H "(m, l) in" "$OUT"/trace_*.txt
echo "== correctness, quick ($(date -u +%T))"
timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
for a in "5000 32 wht_so4" "5000 0 rwht_so4"; do
  set -- $a
  RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context $1 --window $2 --rotation $3 \
    --steps 3 >> "$OUT/cache.log" 2>&1; echo "cache $a: $(tail -1 "$OUT/cache.log")"
done
cupti_busy
echo "== done ($(date -u +%T))"
