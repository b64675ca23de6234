#!/usr/bin/env bash
# Session 18 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the 108 needles of session 14's GPU
# table (`rq eval niah --trials 12 --seed 1`) with the default cache of now (kv.edge_layers 1, value gain, pair
# codebooks, 32-token window); fp16 runs first and must retrieve the same 101 as then.
set -u
OUT=${OUT:-$PWD/s18c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== niah ($(date -u +%T))"
timeout ${T:-540} python3 -m rq_cli.main eval niah --kv isoquant3,turbo3 --trials 12 --seed 1 --json > "$OUT/niah.json" 2> "$OUT/niah.err"
echo "rc $?"
python3 -c "
import json; d=json.load(open('$OUT/niah.json'))
for m, r in d['modes'].items(): print(m, round(r['accuracy'], 4), [c['accuracy'] for c in r['cells']], r.get('paired'))" 2>&1 | tail -4
tail -2 "$OUT/niah.err"
echo "== done ($(date -u +%T))"
