#!/usr/bin/env bash
# Session 15, call 6 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the fp16 segment that moves
# through its buffer (no copies a decode step), the long prompt's buffer released at end_prefill, and kv.prefill_fp16
# (a long prompt compressed while it is prefilled). (1) Cache checks through attn_v5 with the window, 240 decode
# steps (past the buffer's compaction), scalar and pair codebooks; one with the prompt in chunks of 1024 beyond
# prefill_fp16 (the reference path on the GPU for those chunks). (2) cache_step.py: attend's host-inclusive cost a
# layer, fp16 vs isoquant3 vs the copying window, 48 layers. (3) profile_gpu.py again (whole decode step).
set -u
OUT=${OUT:-$PWD/s15c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== cache checks ($(date -u +%T))"
RQ_CHECK_VERSIONS=v5 timeout 120 python3 benchmarks/v4_cache_check.py --context 5000 --window 32 --steps 240 \
  > "$OUT/check_scalar.log" 2>&1; tail -1 "$OUT/check_scalar.log"; grep -c "^ok" "$OUT/check_scalar.log"
RQ_CHECK_VERSIONS=v5 timeout 120 python3 benchmarks/v4_cache_check.py --context 5000 --window 32 --steps 240 \
  --pair-points 128,32 > "$OUT/check_pair.log" 2>&1; tail -1 "$OUT/check_pair.log"; grep -c "^ok" "$OUT/check_pair.log"
RQ_CHECK_VERSIONS=v5 timeout 120 python3 benchmarks/v4_cache_check.py --context 9000 --window 32 --steps 4 \
  --pair-points 128,32 --prefill-chunk 1024 > "$OUT/check_prefill.log" 2>&1; tail -3 "$OUT/check_prefill.log"
echo "== cache_step ($(date -u +%T))"
timeout 200 python3 benchmarks/cache_step.py --contexts 2048,32768,131072 --layers 48 --steps 32 --rounds 3 --json \
  > "$OUT/cache_step.json" 2> "$OUT/cache_step.err"; python3 -c "
import json; d = json.load(open('$OUT/cache_step.json'))
for r in d['rows']: print(r['context'], r['cache'], round(r['us_per_layer'], 1), round(r['vs_fp16'], 2))" || tail -5 "$OUT/cache_step.err"
echo "== profile ($(date -u +%T))"
timeout 200 python3 benchmarks/profile_gpu.py --layers 4 --contexts 2048,8192,32768,131072 --kv fp16,isoquant3 \
  --repeats 20 --warmup 5 --out "$OUT/profile" > "$OUT/profile.log" 2>&1; echo "rc $?"
grep -E "^\| [0-9]" "$OUT/profile.log" | head -12
echo "== done ($(date -u +%T))"
