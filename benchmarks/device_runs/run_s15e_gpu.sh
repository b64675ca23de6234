#!/usr/bin/env bash
# Session 15, call 11 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the window's tokens coded a
# window's worth at a time (one kv_append per ~33 decode steps instead of one a step; attention reads exactly what it
# read before). (1) Cache checks through attn_v5: 70 steps at 5,000 tokens with the 32-token window (two batches),
# pair codebooks; 260 steps at 1,000 tokens with an 8-token window (past the fp16 buffer's compaction), scalar.
# (2) cache_step.py: fp16 / isoquant3 / the pre-session-15 cache. (3) profile_gpu.py (whole decode step).
set -u
OUT=${OUT:-$PWD/s15e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== cache checks ($(date -u +%T))"
RQ_CHECK_VERSIONS=v5 timeout 100 python3 benchmarks/v4_cache_check.py --context 5000 --window 32 --steps 70 \
  --pair-points 128,32 > "$OUT/check_pair.log" 2>&1; tail -1 "$OUT/check_pair.log"; grep -c "^ok" "$OUT/check_pair.log"
RQ_CHECK_VERSIONS=v5 timeout 100 python3 benchmarks/v4_cache_check.py --context 1000 --window 8 --steps 260 \
  > "$OUT/check_scalar.log" 2>&1; tail -1 "$OUT/check_scalar.log"; grep -c "^ok" "$OUT/check_scalar.log"
echo "== cache_step ($(date -u +%T))"
timeout 200 python3 benchmarks/cache_step.py --contexts 2048,32768,131072 --layers 48 --steps 64 --rounds 3 --json \
  > "$OUT/cache_step.json" 2> "$OUT/cache_step.err"; python3 -c "
import json; d = json.load(open('$OUT/cache_step.json'))
for r in d['rows']: print(r['context'], r['cache'], round(r['us_per_layer'], 1), round(r['vs_fp16'], 2))" || tail -5 "$OUT/cache_step.err"
echo "== profile ($(date -u +%T))"
timeout 200 python3 benchmarks/profile_gpu.py --layers 4 --contexts 2048,8192,32768,131072 --kv fp16,isoquant3 \
  --repeats 20 --warmup 5 --out "$OUT/profile" > "$OUT/profile.log" 2>&1; echo "rc $?"
grep -E "^\| [0-9]" "$OUT/profile.log" | head -8
echo "== done ($(date -u +%T))"
