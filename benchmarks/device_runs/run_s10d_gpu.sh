#!/usr/bin/env bash
# Session 10, call 4 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590): the committed
# default (call 3's fixed-cost set without its define switches: the same SASS with nvcc here). kernels_check's quick v5
# set, ncu kernel-alone beside fp16 SDPA at 132 and 264 blocks, CUPTI busy a layer, then the peers' table.
set -u
OUT=${OUT:-$PWD/s10d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
echo "== correctness, quick ($(date -u +%T))"
timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
ncu_kernel_time "fp16 SDPA,v5 256" 256:2:132:1:2:2,256:2:264:1:2:2
cupti_busy
peer_table 300
echo "== done ($(date -u +%T))"
