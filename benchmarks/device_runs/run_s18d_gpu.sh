#!/usr/bin/env bash
# Session 18 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): issue 4's numbers with the code of
# now (no kernel change since session 15; session 16's host-time change since the last table): GPU busy a layer
# (CUPTI, fp16 and v5, 32K and 128K), then every peer in one process (benchmarks/attention.py, as session 14's table).
set -u
OUT=${OUT:-$PWD/s18d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
echo "== CUPTI busy a layer ($(date -u +%T))"
timeout 150 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 \
  --methods "fp16,v5,v5pair" --out "$OUT/busy_{T}.json" > "$OUT/busy.log" 2>&1
echo "rc $?"; grep "^summary" "$OUT/busy.log"
peer_table 300
echo "== done ($(date -u +%T))"
