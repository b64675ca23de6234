#!/usr/bin/env bash
# Session 11, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the last block's (m, l)
# loads ahead of the partials (MLFIRST), the launch bound at one block an SM (132 blocks: 168-186 registers), and
# one round of 33 partial loads under it (NC33): trace + ncu A/B; then the quick v5 set with each new define.
set -u
OUT=${OUT:-$PWD/s11b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
v5_variant "" 2
v5_variant MLFIRST 2
v5_variant "" 1
v5_variant MLFIRST 1
v5_variant MLFIRST,NC33 1
echo "== correctness, quick ($(date -u +%T))"
RQ_V5_DEFS=MLFIRST timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
RQ_V5_DEFS=MLFIRST,NC33 RQ_V5_MINB=1 timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 \
  > "$OUT/check_nc33.log" 2>&1
grep -E "FAIL|passed" "$OUT/check_nc33.log" | tail -3
echo "== done ($(date -u +%T))"
