#!/usr/bin/env bash
# Session 6, fourth call (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 480):
#   1. benchmarks/diag/launch_cost.py: what a chained layer costs outside the kernel (null kernels, SM clocks)
#   2. `rq eval ppl` on the GPU (fp16, isoquant3 and turbo3 with the default window: the kernels' path end to
#      end on the bundled model; the same commands on the CPU give the reference numbers)
#   3. `rq eval niah --trials 12 --seed 1` on the GPU: 108 needles a mode, an independent draw from session 5's
set -u
OUT=${OUT:-$PWD/s6d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
export PATH=$HOME/.local/bin:$PATH
echo "== 1. launch cost ($(date -u +%T))"
timeout ${T1:-120} python3 benchmarks/diag/launch_cost.py --context 32768 --layers 64 --out "$OUT/launch_cost.json" \
  > "$OUT/launch_cost.log" 2>&1
tail -8 "$OUT/launch_cost.log"
RQ="python3 -m rq_cli.main"
echo "== 2. rq eval ppl on the GPU ($(date -u +%T))"
for kv in fp16 isoquant3 turbo3; do
  timeout 60 $RQ eval ppl --kv $kv --windows 2 --json > "$OUT/ppl_$kv.json" 2> "$OUT/ppl_$kv.err"
  echo "$kv rc=$? $(cat "$OUT/ppl_$kv.json" | head -c 300) $(tail -2 "$OUT/ppl_$kv.err")"
done
echo "== 3. niah ($(date -u +%T))"
timeout ${T3:-200} $RQ eval niah --trials ${TRIALS:-12} --seed 1 --json > "$OUT/niah.json" 2> "$OUT/niah.err"
echo "rc=$?"; python3 -c "
import json; d=json.load(open('$OUT/niah.json'))
for m, r in d['modes'].items(): print(m, r['accuracy'], [c['accuracy'] for c in r['cells']])" 2>&1; tail -3 "$OUT/niah.err"
echo "== done ($(date -u +%T))"
