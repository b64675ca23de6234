#!/usr/bin/env bash
# Session 10, call 5 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): where two blocks an SM start
# to pay (ncu kernel alone at 64K and 128K, 132 / 198 / 264 blocks), then CUPTI busy a layer with the blocks chosen by
# context (kernels.v5_blocks: 264 from 64K tokens).
set -u
OUT=${OUT:-$PWD/s10e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
echo "== ncu by blocks ($(date -u +%T))"
timeout 90 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" \
  python3 benchmarks/kernel_time.py --contexts 65536,131072 --reps 3 --methods "v5 256" \
  --v5-configs 256:2:132:1:2:2,256:2:198:1:2:2,256:2:264:1:2:2 --schedule "$OUT/schedule.json" > "$OUT/kt.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu.csv" --schedule "$OUT/schedule.json" 2>&1 | grep "^| [0-9]"
rm -f "$OUT/kt.log"
cupti_busy
echo "== done ($(date -u +%T))"
