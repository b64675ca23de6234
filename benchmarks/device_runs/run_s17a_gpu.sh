#!/usr/bin/env bash
# Session 17, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): session 16's host-time
# change on the H200 (attn_v5's memoized launch plan, env reads through rq_core/env.py): the cache's decode-step
# `attend` host included (cache_step.py, as session 15 ran it: 85.6 / 94.9 / 94.2 us a layer then) and `rq run` on the
# bundled model in turns (session 15: isoquant3 373.8-418.1 tok/s, fp16 473.1-513.7); then the bounded prefill's
# decoded path end to end against float64 (v4_cache_check.py --prefill-chunk, 40,000 tokens).
set -u
OUT=${OUT:-$PWD/s17a_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== cache_step ($(date -u +%T))"
timeout 270 python3 benchmarks/cache_step.py --contexts 2048,32768,131072 --layers 48 --steps 32 --rounds 3 --json \
  > "$OUT/cache_step.json" 2> "$OUT/cache_step.err"; echo "rc $?"; python3 -c "
import json; d = json.load(open('$OUT/cache_step.json'))
for r in d['rows']: print(r['context'], r['cache'], round(r['us_per_layer'], 1), round(r['vs_fp16'], 2))" || tail -5 "$OUT/cache_step.err"
for kv in isoquant3 fp16 isoquant3 fp16; do
  echo "== rq run --kv $kv ($(date -u +%T))"
  timeout 90 python3 -m rq_cli.main run --prompt "ROMEO:" --kv $kv --max-tokens 300 --temp 0 --json \
    > "$OUT/run_$kv.json" 2> "$OUT/run_$kv.err"; echo "rc $?"
  python3 -c "
import json; d = json.load(open('$OUT/run_$kv.json'))
print({k: d.get(k) for k in ('kv_mode', 'generated_tokens', 'steady_decode_tok_per_s', 'prefill_s', 'kv_bytes')})" 2>&1 | tail -1
done
echo "== v4_cache_check prefill ($(date -u +%T))"
RQ_CHECK_VERSIONS=v5 timeout 170 python3 benchmarks/v4_cache_check.py --context 40000 --window 32 --pair-points 128,32 \
  --prefill-chunk 1024 --prefill-fp16 4096 --steps 2 > "$OUT/v4_cache_check.log" 2>&1; echo "rc $?"
grep -c FAIL "$OUT/v4_cache_check.log"; tail -8 "$OUT/v4_cache_check.log"
echo "== done ($(date -u +%T))"
