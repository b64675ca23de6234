#!/usr/bin/env bash
# attn_v4w (v4 + the cache's fp16 window in the same launch) on the H200 in ONE device call, after
# `bash .device/bin/gpu-stage-a` (carry .device/a, .device/bin):
#     run: bash benchmarks/device_runs/run_window_gpu.sh      carry: [".device/b", ".device/bin"]     timeout_s: 300
#   1. the caches' GPU path against float64 (IsoQuant-3 with fp16 windows 1, 32 and 128, contexts 5,000 and
#      40,000; v4 only: TurboQuant stays on v3 + matmuls by default)
#   2. µs per layer, chained layers (as in a decode step): v4 against v4 + a 32-token window, fp16 SDPA
# Outputs go to $OUT as few files (the device returns a limited number).
set -u
OUT=${OUT:-$PWD/window_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for ctx in 5000 40000; do
  for w in 1 32 128; do
    echo "== cache check: context $ctx, window $w ($(date -u +%T))"
    RQ_CHECK_VERSIONS=v4 timeout ${T1:-60} python3 benchmarks/v4_cache_check.py --context $ctx --steps 3 --window $w 2>&1 \
      | tee -a "$OUT/window_check.log" | grep -v "^ok "
  done
done
echo "== attention, chained ($(date -u +%T))"
timeout ${T2:-150} python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 16 --reps 20 --chain \
  --contexts "${CONTEXTS:-4096,32768,131072}" \
  --methods "=IsoQuant-3 v4 (one launch),=IsoQuant-3 v4 + fp16 window 32 (one launch)" --out "$OUT" 2>&1 \
  | tee "$OUT/window_bench.log" | grep -E "^\||FAILED|copy bandwidth"
echo "== done ($(date -u +%T))"
