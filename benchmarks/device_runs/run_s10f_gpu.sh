#!/usr/bin/env bash
# Session 10, call 6 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): attn_v5's scratch as one
# output (o_part, ml_part and lse were three): kernels_check's quick v5 set (reads lse from the scratch), the cache's
# checks (window 32 at 5,000 and 40,000 tokens, rwht_so4), then decode-like time a layer of fp16, v5 and v5 + window
# in one process (attention.py's harness as the peers' table; compare with call 4's table).
set -u
OUT=${OUT:-$PWD/s10f_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== correctness, quick ($(date -u +%T))"
timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
for a in "5000 32 wht_so4" "40000 32 wht_so4" "5000 0 rwht_so4"; do
  set -- $a
  RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context $1 --window $2 --rotation $3 \
    --steps 3 >> "$OUT/cache.log" 2>&1; echo "cache $a: $(tail -1 "$OUT/cache.log")"
done
echo "== decode-like ($(date -u +%T))"
mkdir -p "$OUT/table"
timeout 200 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 5 --chain \
  --pipeline 4 --contexts 4096,32768,131072 \
  --methods "=fp16 SDPA,=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch)" \
  --out "$OUT/table" > "$OUT/table.log" 2>&1
grep -E "^\||FAILED|Error" "$OUT/table.log"
echo "== done ($(date -u +%T))"
