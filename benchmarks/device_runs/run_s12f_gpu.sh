#!/usr/bin/env bash
# Session 12, call 7 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the default by context
# (256 threads below 90K packed tokens, 384 from there; one ring slot; HALFOP). A trace of both thread counts with the
# new stamp 14 (the warps' slabs merged) to split the 384's 2.7 us merge; every v5 correctness case and the windowed
# cache check at 100,000 tokens (384 threads with the window); CUPTI busy a layer; every peer in one process.
set -u
OUT=${OUT:-$PWD/s12f_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
for n in 256 384; do
  RQ_V5_NTH=$n timeout 40 python3 benchmarks/diag/v5_trace.py --contexts 4096,131072 --reps 2 > "$OUT/trace_$n.txt" 2>&1
  echo "== trace $n"; grep -E "^== T|loops end|slabs|partials written" "$OUT/trace_$n.txt" | sed -E 's/\(runs[^)]*\)//; s/, blocks. starts.*//'
done
echo "== correctness ($(date -u +%T))"
timeout 150 python3 benchmarks/kernels_check.py --only v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
RQ_CHECK_VERSIONS=v5 timeout 90 python3 benchmarks/v4_cache_check.py --context 100000 --window 32 --rotation wht_so4 \
  --steps 3 > "$OUT/cache.log" 2>&1; echo "cache 100000 32 wht_so4: $(tail -1 "$OUT/cache.log")"
cupti_busy
peer_table 200
echo "== done ($(date -u +%T))"
