#!/usr/bin/env bash
# Session 12, call 3 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): what bounds the main loop.
# Call 2 found the next step's scores beside this step's softmax (PIPE) no faster, the register transpose alone 1 us
# faster at 128K. Timing probes against NOPIPE (trace + ncu at 132 blocks, one block an SM): the query's lo halves
# left out (NOLOQ: 8 of 32 matrix ops a step), the weights' too (NOLOV: 16 of 32), and, with wrong results, the keys'
# or values' table lookups left out (PROBE_KRAW / PROBE_VRAW: ~78 instructions a step each, 32 of them loads).
set -u
OUT=${OUT:-$PWD/s12b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
for defs in NOPIPE NOPIPE,NOLOQ NOPIPE,NOLOQ,NOLOV NOPIPE,PROBE_KRAW NOPIPE,PROBE_VRAW NOPIPE,PROBE_KRAW,PROBE_VRAW; do
  v5_variant "$defs" 1
done > "$OUT/variants.log" 2>&1
grep -E "^== [A-Za-z]|span| \| 128K| \| 32K| \| 4K" "$OUT/variants.log"
echo "== done ($(date -u +%T))"
