#!/usr/bin/env bash
# Session 17, call 11 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): kv.value_gain (the values'
# stored norms times the codebook's reconstruction gain, applied after kv_append) through the GPU paths: the cache
# against float64 (attn_v5 with the fp16 window; pair and scalar codebooks; a long prompt compressed while prefilled)
# and the stored norms against quantize_kv's times the gain; then `rq run` on the bundled model.
set -u
OUT=${OUT:-$PWD/s17g_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for spec in "5000 128,32 0" "3000 off 0" "20000 128,32 1024"; do
  set -- $spec
  pp=""; [ "$2" != off ] && pp="--pair-points $2"
  pc=""; [ "$3" != 0 ] && pc="--prefill-chunk $3 --prefill-fp16 4096"
  echo "== v4_cache_check context $1 pairs $2 chunk $3 ($(date -u +%T))"
  RQ_CHECK_VERSIONS=v5 timeout 150 python3 benchmarks/v4_cache_check.py --context $1 --window 32 $pp $pc --steps 3 \
    > "$OUT/v4_cache_check_$1_${2/,/x}.log" 2>&1; echo "rc $?"; grep -c FAIL "$OUT/v4_cache_check_$1_${2/,/x}.log"
  grep "norms\|all passed\|FAIL\|last prompt" "$OUT/v4_cache_check_$1_${2/,/x}.log" | head -6
done
echo "== rq run ($(date -u +%T))"
timeout 120 python3 -m rq_cli.main run --prompt "ROMEO:" --kv isoquant3 --max-tokens 100 --temp 0 --json > "$OUT/run.json" \
  2> "$OUT/run.err"; echo "rc $?"
python3 -c "
import json; d = json.load(open('$OUT/run.json'))
print({k: d.get(k) for k in ('kv_mode', 'kv_value_gain', 'generated_tokens', 'steady_decode_tok_per_s')}); print(repr(d['text'][:160]))"
echo "== done ($(date -u +%T))"
