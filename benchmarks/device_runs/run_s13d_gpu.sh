#!/usr/bin/env bash
# Session 13, call 9 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the final default (the
# (m, l) arrays in the table's padding, NSL3, 384 threads from 75K): every v5 correctness case with the 384 and 512
# configurations and the cache checks (window, rwht_so4), CUPTI busy a layer, every peer in one process.
set -u
OUT=${OUT:-$PWD/s13d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
echo "== correctness ($(date -u +%T))"
timeout 170 python3 benchmarks/kernels_check.py --only v5 --v5-configs 384:1:1:2:1,512:1:1:2:1 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
for a in "5000 32 wht_so4" "40000 32 wht_so4" "5000 0 rwht_so4"; do
  set -- $a
  RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context $1 --window $2 --rotation $3 \
    --steps 3 > "$OUT/cache_$1_$2_$3.log" 2>&1; echo "cache $a: $(tail -1 "$OUT/cache_$1_$2_$3.log")"
done
cupti_busy
peer_table 220
echo "== done ($(date -u +%T))"
