#!/usr/bin/env bash
# Session 10, call 8 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; the session's last ~5 device
# minutes): NDEDUP (a C fragment's elements that share a token load its norms once: 526 -> 515 instructions a step)
# A/B, the quick v5 set with it, CUPTI busy with it, then every peer in one process with it (the README's table).
# Ran 2026-11-30 13:00 UTC (benchmarks/results/s10_2026-11-30/call8): NDEDUP gave no gain and was taken out of the body
# (docs/KERNEL_NOTES.md, "Session 10", call 8, says what it was); the table ran out of the call's time after 4K.
set -u
OUT=${OUT:-$PWD/s10h_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
for defs in "" NDEDUP; do v5_variant "$defs"; done
export RQ_V5_DEFS=NDEDUP
echo "== correctness, quick ($(date -u +%T))"
timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
cupti_busy
peer_table 200
echo "== done ($(date -u +%T))"
