#!/usr/bin/env bash
# Session 15, call 13 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): `rq run` end to end on the
# GPU with the session's cache (window tokens coded in batches) against the fp16 cache, bundled model, greedy, 300 tokens.
set -u
OUT=${OUT:-$PWD/s15f_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for kv in isoquant3 fp16 isoquant3; do
  echo "== rq run --kv $kv ($(date -u +%T))"
  timeout 250 python3 -m rq_cli.main run --prompt "ROMEO:" --kv $kv --max-tokens 300 --temp 0 --json \
    > "$OUT/run_$kv.json" 2> "$OUT/run_$kv.err"; echo "rc $?"
  python3 -c "
import json; d = json.load(open('$OUT/run_$kv.json'))
print({k: d.get(k) for k in ('kv_mode', 'kv_pair_points', 'generated_tokens', 'steady_decode_tok_per_s', 'decode_tok_per_s', 'first_step_s', 'kv_bytes')})
print(repr(d.get('text', '')[:300]))" 2>&1 | tail -3
done
echo "== done ($(date -u +%T))"
