#!/usr/bin/env bash
# Session 15, call 9 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): where a compressed cache's
# decode `attend` spends its host time (cProfile of cache_step.py, isoquant3 at 2K, 48 layers), and cache_step.py
# again with the window compressed 16 tokens at a time (batch16) beside fp16, isoquant3 and the copying window.
set -u
OUT=${OUT:-$PWD/s15d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== cache_step ($(date -u +%T))"
timeout 240 python3 benchmarks/cache_step.py --contexts 2048,32768,131072 --layers 48 --steps 32 --rounds 3 --json \
  > "$OUT/cache_step.json" 2> "$OUT/cache_step.err"; python3 -c "
import json; d = json.load(open('$OUT/cache_step.json'))
for r in d['rows']: print(r['context'], r['cache'], round(r['us_per_layer'], 1), round(r['vs_fp16'], 2))" || tail -5 "$OUT/cache_step.err"
echo "== cProfile ($(date -u +%T))"
timeout 120 python3 benchmarks/diag/prof_attend.py > "$OUT/prof_attend.log" 2>&1
grep -A 28 "tottime" "$OUT/prof_attend.log" | cut -c1-150
echo "== done ($(date -u +%T))"
