#!/usr/bin/env bash
# Session 13: written for a 15th call that the device budget no longer allowed (NOT RUN; it sets RQ_V5_DEFS=KREP itself)
# (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin):
# pair codebooks with the keys' table lane-replicated (KREP: 16 KB on a 16 KB boundary, 256 threads): kernels_check's
# quick v5 set (its pair cases among them), then CUPTI busy a layer at 128K against the scalar default.
set -u
OUT=${OUT:-$PWD/s13g_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== check ($(date -u +%T))"
RQ_V5_DEFS=KREP timeout 80 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed|/p128" "$OUT/check.log" | tail -14
echo "== busy ($(date -u +%T))"
RQ_V5_DEFS=KREP timeout 60 python3 benchmarks/diag/chain_timeline.py --contexts 131072 --layers 64 --reps 3 \
  --methods "fp16,v5,v5pair" --out "$OUT/busy_{T}.json" > "$OUT/busy.log" 2>&1
grep -E "^summary|Error" "$OUT/busy.log" | head -6; rm -f "$OUT"/busy_*.json
echo "== done ($(date -u +%T))"
