#!/usr/bin/env bash
# Session 11, call 8 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; the session's last device
# minutes): MLFIRST again now that the last block no longer reloads the rotation (call 2 had it behind those loads):
# trace + ncu A/B; then every v5 correctness case and the caches' checks on the final default.
set -u
OUT=${OUT:-$PWD/s11h_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
for defs in "" MLFIRST; do v5_variant "$defs" 1; done
grep -H "(m, l) in" "$OUT"/trace_*.txt
v5_correctness
echo "== done ($(date -u +%T))"
