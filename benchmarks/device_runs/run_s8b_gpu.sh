#!/usr/bin/env bash
# Session 8, device call 3 (right after run_s8_gpu.sh on the warm machine; carry .device/b,
# .device/bin; timeout 300): does rq_core.kernel_cache (RQ_KERNEL_CACHE=1) remove the per-process JIT compile?
#   1. process 1 compiles v5 + window through MLX (timed), then through kernel_cache (NVRTC -> MLX's PTX cache)
#   2. process 2: the first launch must take milliseconds, its output equal to MLX's own compile's
#   3. rq run on the bundled model with RQ_KERNEL_CACHE=1, twice: first_step_s of the second process
set -u
OUT=${OUT:-$PWD/s8b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
timeout 120 python3 benchmarks/diag/kernel_cache_check.py --phase write --out "$OUT/kc" 2>&1 | tail -20
timeout 60 python3 benchmarks/diag/kernel_cache_check.py --phase read --out "$OUT/kc" 2>&1 | tail -12
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
P=$(python3 -c "print(open('rq_core/assets/heldout.txt').read()[:1000])")
for i in 1 2; do
  RQ_KERNEL_CACHE=1 timeout 150 python3 -c "$R" run --prompt "$P" -n 64 --json --kv isoquant3 > "$OUT/run$i.json" 2> "$OUT/run$i.err"
  python3 -c "import json; d=json.load(open('$OUT/run$i.json')); print($i, {k: d[k] for k in ('first_step_s','steady_decode_tok_per_s','decode_tok_per_s')})" 2>&1 | tail -1
done
