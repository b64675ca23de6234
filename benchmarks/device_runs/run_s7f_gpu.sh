#!/usr/bin/env bash
# Session 7, device call 7 (stage-a first; carry .device/b, .device/bin; timeout 290): rq run on the bundled
# model with the first decode step timed apart (first_step_s, steady_decode_tok_per_s), ~1,500-token prompt.
set -u
OUT=${OUT:-$PWD/s7f_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
P=$(python3 -c "print(open('rq_core/assets/heldout.txt').read()[:4000])")
for kv in isoquant3 fp16 isoquant3 fp16; do
  timeout 100 python3 -c "$R" run --prompt "$P" -n 256 --json --kv $kv > "$OUT/run.json" 2> "$OUT/run.err"
  python3 -c "import json; d=json.load(open('$OUT/run.json')); print('$kv', {k: round(d[k], 4) if isinstance(d[k], float) else d[k] for k in ('prompt_tokens','generated_tokens','prefill_tok_per_s','decode_tok_per_s','first_step_s','steady_decode_tok_per_s','kv_bytes','kv_bytes_fp16')})" 2>&1 | tail -1
  cat "$OUT/run.json" >> "$OUT/runs.jsonl"; echo >> "$OUT/runs.jsonl"
done
rm -f "$OUT/run.json"
