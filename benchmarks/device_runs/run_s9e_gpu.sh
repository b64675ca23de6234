#!/usr/bin/env bash
# Session 9, round 3 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590): the query row
# requested first and the last block's one-pass merge of the splits. Correctness (kernels_check v5, all cases; the
# cache's paths), the phase trace, ncu kernel-alone beside fp16 SDPA, CUPTI busy a layer, then the peers' table.
set -u
OUT=${OUT:-$PWD/s9e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
v5_correctness
v5_phase_trace
ncu_kernel_time "fp16 SDPA,v5 256" 256:2:132:1:2:2
cupti_busy
peer_table 200
echo "== done ($(date -u +%T))"
