#!/usr/bin/env bash
# Session 14, call 6 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): isoquant3's new default
# codebooks (pairs, 128 / 32 points) end to end on the GPU: `rq eval niah --trials 12 --seed 1` (the README's
# 108-needle GPU draw; fp16's outcomes must repeat), then every peer in one process with the pair rows added.
set -u
OUT=${OUT:-$PWD/s14c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
echo "== niah ($(date -u +%T))"
timeout 230 python3 -m rq_cli.main eval niah --kv isoquant3 --trials 12 --seed 1 --json > "$OUT/niah.json" 2> "$OUT/niah.err"
python3 -c "
import json; d=json.load(open('$OUT/niah.json'))
for m, r in d['modes'].items(): print(m, round(r['accuracy'], 4), [c['accuracy'] for c in r['cells']], r.get('paired'))" 2>&1
tail -2 "$OUT/niah.err"
peer_table 260
echo "== done ($(date -u +%T))"
