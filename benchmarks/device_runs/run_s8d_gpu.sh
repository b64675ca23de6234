#!/usr/bin/env bash
# Session 8, device call 6 (right after run_s8c_gpu.sh on the warm machine; carry .device/b, .device/bin;
# timeout 590): the peers' table with the new default, and rq run with the kernel cache on by default.
#   1. attention.py, 64 chained layers a decode step, 4 steps queued back to back (--pipeline 4), 4K / 32K /
#      128K: fp16 SDPA, qmm 8- and 4-bit, TurboQuant-3, IsoQuant-3 four-kernel, v5, v5 + window 32 (the default)
#   2. rq run on the bundled model, isoquant3 twice (a fresh machine: the first process compiles into MLX's PTX
#      cache, the second reads it), fp16 once
set -u
OUT=${OUT:-$PWD/s8d_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. attention table, pipelined decode steps ($(date -u +%T))"
timeout 360 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 5 --chain --pipeline 4 \
  --contexts 4096,32768,131072 \
  --methods "=fp16 SDPA,=qmm 8-bit,=qmm 4-bit,=TurboQuant-3 (dense),=IsoQuant-3 four-kernel,=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch)" \
  --out "$OUT/table" > "$L/table.log" 2>&1
grep -E "^\||FAILED|Error" "$L/table.log"
echo "== 2. rq run ($(date -u +%T))"
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
P=$(python3 -c "print(open('rq_core/assets/heldout.txt').read()[:1000])")
for run in iso1:isoquant3 iso2:isoquant3 fp16:fp16; do
  tag=${run%%:*}; kv=${run##*:}
  timeout 150 python3 -c "$R" run --prompt "$P" -n 256 --json --kv $kv > "$L/run_$tag.json" 2> "$L/run_$tag.err"
  python3 -c "import json; d=json.load(open('$L/run_$tag.json')); print('$tag', {k: d.get(k) for k in ('prompt_tokens','first_step_s','steady_decode_tok_per_s','decode_tok_per_s')})" 2>&1 | tail -1
done
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
