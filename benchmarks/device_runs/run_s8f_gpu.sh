#!/usr/bin/env bash
# Session 8, device call 10 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 400):
# v5's default grid 264 -> 132 blocks (call 5's ncu). Correctness at the new default, then decode-like timing
# (--pipeline 4, 64 chained layers): fp16, v5 default (132), v5 at 264 blocks, v5 + window 32 (the cache's default)
set -u
OUT=${OUT:-$PWD/s8f_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. correctness ($(date -u +%T))"
timeout 120 python3 benchmarks/kernels_check.py --only v5 --out "$L/v5" > "$L/check_v5.log" 2>&1
grep -E "FAIL|passed" "$L/check_v5.log" | tail -4
RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context 40000 --window 32 --steps 3 > "$L/cache.log" 2>&1
tail -1 "$L/cache.log"
echo "== 2. pipelined decode steps ($(date -u +%T))"
timeout 240 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 5 --chain --pipeline 4 \
  --contexts 4096,32768,131072 \
  --methods "=fp16 SDPA,=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch),IsoQuant-3 v5 256" \
  --v5-configs 256:2:264:1:2:2 --out "$OUT/pipe" > "$L/pipe.log" 2>&1
grep -E "^\||FAILED|Error" "$L/pipe.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
