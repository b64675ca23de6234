#!/usr/bin/env bash
# Session 13, call 13 (run 19:00 UTC; its d = 64 pair case then had an unaligned capacity, fixed in make_case since) (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): pair codebooks on the GPU
# (kv.pair_points (128, 32): kv_append's pair path, attn_v5 / attn_v5w with PK / PV). kernels_check's quick v5 set
# (its 10 pair cases among them), the pair cache at 5,000 and 40,000 tokens with the window (stored codes against
# quantize_kv, outputs against float64), the scalar cache at 5,000 (unchanged default), then kernel time and CUPTI busy
# of the pair setting against the default at 32K and 128K.
set -u
OUT=${OUT:-$PWD/s13f_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== check ($(date -u +%T))"
timeout 120 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed|/p128" "$OUT/check.log" | tail -14
for a in "5000 32 128,32" "40000 32 128,32" "5000 32 "; do
  set -- $a
  RQ_CHECK_VERSIONS=v5 timeout 90 python3 benchmarks/v4_cache_check.py --context $1 --window $2 --steps 2 \
    ${3:+--pair-points $3} > "$OUT/cache_$1_${3:-scalar}.log" 2>&1
  echo "cache $1 window $2 pair ${3:-none}: $(grep -c '^ok' "$OUT/cache_$1_${3:-scalar}.log") ok, $(tail -1 "$OUT/cache_$1_${3:-scalar}.log")"
  grep FAIL "$OUT/cache_$1_${3:-scalar}.log" | head -3
done
echo "== busy ($(date -u +%T))"
timeout 150 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 \
  --methods "fp16,v5,v5pair" --out "$OUT/busy_{T}.json" > "$OUT/busy.log" 2>&1
grep -E "^summary|Error|error" "$OUT/busy.log" | head -10; rm -f "$OUT"/busy_*.json
echo "== done ($(date -u +%T))"
