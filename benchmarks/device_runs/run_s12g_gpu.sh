#!/usr/bin/env bash
# Session 12, call 8 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): what makes 384 threads'
# slab merge 2.1 us (256 threads: 0.5)? Timing probes with wrong results, trace at 4K and 32K: the second round's
# adds left out (PROBE_NORMW), and the second barrier too (PROBE_NOBAR2).
set -u
OUT=${OUT:-$PWD/s12g_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for d in "" PROBE_NORMW PROBE_NORMW,PROBE_NOBAR2; do
  t=${d:-base}; t=${t//,/_}
  RQ_V5_DEFS=$d RQ_V5_NTH=384 timeout 30 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768 --reps 2 > "$OUT/trace_$t.txt" 2>&1
  echo "== $t"; grep -E "^== T|loops end|slabs|partials written" "$OUT/trace_$t.txt" | sed -E 's/\(runs[^)]*\)//; s/, blocks. starts.*//'
done
echo "== done ($(date -u +%T))"
