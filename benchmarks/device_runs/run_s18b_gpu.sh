#!/usr/bin/env bash
# Session 18, call 3 (warm machine; carry .device/bin): the bundled model with kv.edge_layers on the H200 end to end:
# `rq eval ppl` (2 windows of 1,024) with the default edge layer at each end, without (--edge-layers 0) and fp16, to
# set beside the CPU's numbers; then `rq run` decode speed in turns.
set -u
OUT=${OUT:-$PWD/s18b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for spec in "isoquant3 1" "isoquant3 0" "fp16 1" "turbo3 1"; do
  set -- $spec
  echo "== rq eval ppl --kv $1 --edge-layers $2 ($(date -u +%T))"
  timeout 200 python3 -m rq_cli.main eval ppl --kv $1 --edge-layers $2 --context 1024 --windows 2 --json \
    > "$OUT/ppl_$1_e$2.json" 2> "$OUT/ppl_$1_e$2.err"; echo "rc $?"; cat "$OUT/ppl_$1_e$2.json"; tail -2 "$OUT/ppl_$1_e$2.err"
done
for round in 1 2; do
  for spec in "isoquant3 1" "isoquant3 0" "fp16 0"; do
    set -- $spec
    echo "== rq run --kv $1 --edge-layers $2 round $round ($(date -u +%T))"
    timeout 90 python3 -m rq_cli.main run --prompt "ROMEO:" --kv $1 --edge-layers $2 --max-tokens 300 --temp 0 --json \
      > "$OUT/run_$1_e$2_$round.json" 2> "$OUT/run_$1_e$2_$round.err"; echo "rc $?"
    python3 -c "
import json; d = json.load(open('$OUT/run_$1_e$2_$round.json'))
print({k: d.get(k) for k in ('kv_mode', 'kv_edge_layers', 'kv_edge_bits', 'kv_pair_points', 'generated_tokens', 'steady_decode_tok_per_s', 'kv_bytes')})" 2>&1 | tail -1
  done
done
echo "== done ($(date -u +%T))"
