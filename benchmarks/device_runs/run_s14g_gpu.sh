#!/usr/bin/env bash
# Session 14, call 14 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): after common.h's
# stream_field (one field extraction for Kernel A, Kernel C word-parallel and the fp32 split kernel): kernels_check
# --only four,fused --quick (the main shape at every context, both Kernel C strategies, the pair and 4-bit-key cases).
set -u
OUT=${OUT:-$PWD/s14g_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== check ($(date -u +%T))"
timeout 200 python3 benchmarks/kernels_check.py --only four,fused --quick > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -6
echo "== done ($(date -u +%T))"
