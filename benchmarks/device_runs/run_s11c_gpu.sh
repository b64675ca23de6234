#!/usr/bin/env bash
# Session 11, call 3 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the new default (one block
# an SM at every context, launch bound (256, 1), the merge's 33 partial loads in one round): trace (with warp 0's
# stamps inside the weights phase) + ncu, every v5 correctness case and the caches' checks, CUPTI busy against fp16.
set -u
OUT=${OUT:-$PWD/s11c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
v5_variant "" 1
v5_correctness
cupti_busy
echo "== done ($(date -u +%T))"
