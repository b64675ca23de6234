#!/usr/bin/env bash
# Session 12, call 10 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; the last device minutes):
# the final default (NSL3 merge; 384 threads from 75K packed tokens): kernels_check's quick v5 set plus the 384-thread
# configuration, then CUPTI busy a layer in the 64-layer chain beside fp16 SDPA.
set -u
OUT=${OUT:-$PWD/s12i_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 384:1:1:2:1 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
cupti_busy
echo "== done ($(date -u +%T))"
