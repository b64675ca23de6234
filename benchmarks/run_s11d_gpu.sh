#!/usr/bin/env bash
# Session 11, call 4 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): half partials (PH: half
# queries' splits write o / l as halves, so the last block's merge reads half the bytes): trace + ncu, every v5
# correctness case and the caches' checks, CUPTI busy against fp16.
set -u
OUT=${OUT:-$PWD/s11d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
v5_variant "" 1
v5_correctness
cupti_busy
echo "== done ($(date -u +%T))"
