#!/usr/bin/env bash
# Session 14, call 7: run_s14c's needles again, alone, with room for MLX's first-run compile (call 6 timed out at 230 s
# on a fresh machine): isoquant3's default (pair codebooks) end to end on the GPU, 108 needles, fp16 beside it.
set -u
OUT=${OUT:-$PWD/s14d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== niah ($(date -u +%T))"
timeout ${T:-520} python3 -m rq_cli.main eval niah --kv isoquant3 --trials 12 --seed 1 --json > "$OUT/niah.json" 2> "$OUT/niah.err"
python3 -c "
import json; d=json.load(open('$OUT/niah.json'))
for m, r in d['modes'].items(): print(m, round(r['accuracy'], 4), [c['accuracy'] for c in r['cells']], r.get('paired'))" 2>&1 | tail -4
tail -2 "$OUT/niah.err"
echo "== done ($(date -u +%T))"
