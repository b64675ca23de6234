#!/usr/bin/env bash
# Session 12, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the softmax's weights to the
# value mma by a register transpose (movmatrix) instead of the per-warp scratch, and the next step's scores computed in
# the same stretch as this step's softmax and values (PIPE). A/B at one block an SM (trace + ncu at 132 blocks):
# NOPIPE,PWSCR = session 11's default; NOPIPE = the transpose alone; "" = both (the new default); VEARLY = every value
# fragment decoded before the softmax too. Then every v5 correctness case on the new default, the GPU's SM count,
# and CUPTI busy a layer.
set -u
OUT=${OUT:-$PWD/s12a_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
python3 -c "import rq_core.kernels as K; print('sm count', K.cuda_sm_count(), 'v5 blocks', K.v5_blocks(131072))"
for defs in NOPIPE,PWSCR NOPIPE "" VEARLY; do v5_variant "$defs" 1; done
echo "== correctness ($(date -u +%T))"
timeout 150 python3 benchmarks/kernels_check.py --only v5 --v5-configs 256:1:1:2:2 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
cupti_busy
echo "== done ($(date -u +%T))"
