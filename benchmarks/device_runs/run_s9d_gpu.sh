#!/usr/bin/env bash
# Session 9, round 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590): the fixed cost
# cut (rotations by a warp a row, partials in the fragments' order, the merge in one barrier by default, one round
# of loads for the splits' weights). Correctness first (kernels_check v5, all cases; the cache's paths), then the
# phase trace, ncu kernel-alone (fp16 SDPA alongside; 132 and 264 blocks), CUPTI busy a layer in a 64-layer chain.
# (The peers' table ran in the next call: peer_table 380.)
set -u
OUT=${OUT:-$PWD/s9d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
v5_correctness
v5_phase_trace
ncu_kernel_time "fp16 SDPA,v5 256" 256:2:132:1:2:2,256:2:264:1:2:2
cupti_busy
echo "== done ($(date -u +%T))"
