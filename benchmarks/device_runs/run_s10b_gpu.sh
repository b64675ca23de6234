#!/usr/bin/env bash
# Session 10, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): attn_v5's fixed cost,
# three changes A/B in one process each (RQ_V5_DEFS): ACQREL (the split counter as one acq_rel atomic, no
# sequentially consistent fences), PRELOAD (the query row's loads before the tables', table loops unrolled), NU8
# (the last block's numerators unrolled 8, not 16: less code to fetch). Phase trace and ncu kernel-alone for each,
# then kernels_check's quick v5 set with all three.
# (Its per-variant step moved to gpu_steps.sh's v5_variant after the call ran: the same commands.)
set -u
OUT=${OUT:-$PWD/s10b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
for defs in "" ACQREL PRELOAD NU8 ACQREL,PRELOAD,NU8; do v5_variant "$defs"; done
echo "== correctness, all three ($(date -u +%T))"
RQ_V5_DEFS=ACQREL,PRELOAD,NU8 timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
echo "== done ($(date -u +%T))"
