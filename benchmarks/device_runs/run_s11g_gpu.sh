#!/usr/bin/env bash
# Session 11, call 7 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): every peer in one
# process with the session's final kernel (benchmarks/README.md's table), its own call (~250 s).
set -u
OUT=${OUT:-$PWD/s11g_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
peer_table 480
echo "== done ($(date -u +%T))"
