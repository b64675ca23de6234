#!/usr/bin/env bash
# Session 8, device call 14 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 240):
# call 12's profile: the loop waits on fixed-latency dependencies with 2 warps a scheduler (8 an SM at 132
# blocks). 512 threads, bound (512, 1), rows through registers (STAGE 0, PF 1): 16 warps an SM at 132 blocks,
# 128 registers, no spills, 566 loop instructions (nvcc here). Correctness, then ncu against the default.
set -u
OUT=${OUT:-$PWD/s8h_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== correctness ($(date -u +%T))"
timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 512:1:1:2:0 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
echo "== ncu ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout 120 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$OUT/ncu.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
  --methods "v5 256,v5 512" --v5-configs 256:2:132:1:2:2,512:1:132:1:2:0,512:1:264:1:2:0 --schedule "$OUT/schedule.json" \
  > "$OUT/kt.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu.csv" --schedule "$OUT/schedule.json" --json "$OUT/kernel_time.json" \
  2>&1 | tee "$OUT/kernel_time.md"
gzip -f "$OUT/ncu.csv"
echo "== done ($(date -u +%T))"
