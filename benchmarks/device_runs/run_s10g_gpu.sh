#!/usr/bin/env bash
# Session 10, call 7 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): fewer instructions in v5's
# warp step (nvcc here: 584 -> 526). EXP2A: the softmax's exp2 as ex2.approx.ftz (no exp2f fix-ups); COPY2: the ring's
# copies from one address a part and step, the slot index unsigned. Trace and ncu for each (v5_variant), the quick v5
# set and the windowed cache check with both, CUPTI busy a layer for the default and for both.
set -u
OUT=${OUT:-$PWD/s10g_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
for defs in "" EXP2A COPY2 EXP2A,COPY2; do v5_variant "$defs"; done
export RQ_V5_DEFS=EXP2A,COPY2
echo "== correctness, quick ($(date -u +%T))"
timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context 5000 --window 32 --rotation wht_so4 \
  --steps 3 > "$OUT/cache.log" 2>&1; echo "cache 5000 32: $(tail -1 "$OUT/cache.log")"
for defs in "" EXP2A,COPY2; do
  echo "== CUPTI busy ${defs:-base} ($(date -u +%T))"
  RQ_V5_DEFS=$defs timeout 100 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 \
    --methods "fp16,v5" --out "$OUT/busy_{T}.json" > "$OUT/busy.log" 2>&1
  grep "^summary" "$OUT/busy.log"; rm -f "$OUT"/busy_*.json
done
echo "== done ($(date -u +%T))"
