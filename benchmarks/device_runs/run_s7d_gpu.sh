#!/usr/bin/env bash
# Session 7, device call 5 (fresh machine: `bash .device/bin/gpu-stage-a` first; carry .device/b, .device/bin;
# timeout 590): v5 with T from a shared length view, its counter views made at once, its Python wrapper
# 31 -> 6 µs a call (measured on the CPU with a stub kernel).
#   1. correctness: kernels_check v5 (20 cases), the caches' path (windows 0 / 32, 5,000 and 40,000 tokens)
#   2. attention.py, 64 chained layers, 4 decode steps queued back to back, and the plain chain: fp16, v5, v5 + window
#   3. chain_timeline at 32K: GPU busy, lead
#   4. rq run on the bundled model, ~1,700-token prompt, 256 new tokens: decode tokens/s, fp16 and isoquant3
set -u
OUT=${OUT:-$PWD/s7d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== 1. correctness ($(date -u +%T))"
timeout 100 python3 benchmarks/kernels_check.py --only v5 > "$OUT/check_v5.log" 2>&1
grep -E "FAIL|passed" "$OUT/check_v5.log" | tail -3
for a in "5000 0" "5000 32" "40000 32"; do set -- $a
  RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context $1 --steps 3 --window $2 \
    > "$OUT/cache_$1_w$2.log" 2>&1; echo "context $1 window $2: $(tail -1 "$OUT/cache_$1_w$2.log")"
done
echo "== 2. attention, pipelined and plain chain ($(date -u +%T))"
M="=fp16 SDPA,=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch)"
timeout 150 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 5 --chain --pipeline 4 \
  --contexts 4096,32768,131072 --methods "$M" --out "$OUT/pipe" > "$OUT/pipe.log" 2>&1
grep -E "^T=|FAILED|Error" "$OUT/pipe.log"
timeout 120 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 10 --chain \
  --contexts 4096,32768,131072 --methods "$M" --out "$OUT/chain" > "$OUT/chain.log" 2>&1
grep -E "^T=|FAILED|Error" "$OUT/chain.log"
echo "== 3. timeline 32K ($(date -u +%T))"
timeout 80 python3 benchmarks/diag/chain_timeline.py --contexts 32768 --layers 64 --reps 3 --methods "fp16,v5,v5w" \
  --out "$OUT/timeline_{T}.json" > "$OUT/timeline.log" 2>&1
grep "^summary" "$OUT/timeline.log"
echo "== 4. rq run decode speed ($(date -u +%T))"
P=$(python3 -c "print(open('rq_core/assets/heldout.txt').read()[:4000])")
for kv in fp16 isoquant3 fp16 isoquant3; do
  timeout 60 python3 -c 'import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()' run --prompt "$P" -n 256 --json --kv $kv > "$OUT/run_$kv.json" 2> "$OUT/run_$kv.err"
  python3 -c "import json,sys; d=json.load(open('$OUT/run_$kv.json')); print('$kv', {k: d[k] for k in ('prompt_tokens','generated_tokens','prefill_tok_per_s','decode_tok_per_s','kv_bytes','kv_bytes_fp16')})" 2>&1 | tail -1
done
echo "== done ($(date -u +%T))"
