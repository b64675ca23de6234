#!/usr/bin/env bash
# attn_v5 on the H200 in ~2 minutes of device time (when little is left): one call on a machine where
# gpu-env finds MLX staged (else first `bash .device/bin/gpu-stage-a` carrying .device/a and .device/bin):
#     run: bash benchmarks/device_runs/run_v5_quick.sh      carry: [".device/b", ".device/bin"]     timeout_s: 200
#   1. kernels_check --only v5 --quick-v5: 9 cases, 4 shape classes, against float64 (<= 60 s)
#   2. GPU time of the kernels alone at 32K and 128K under ncu: v4, v5 configurations (<= 70 s)
#   3. attention.py at 32K and 128K, 16 layers per evaluation: fp16 SDPA, v4, v5 (<= 70 s)
set -u
OUT=${OUT:-$PWD/v5_out}
mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
CFGS=${V5_CFGS:-256:0:264:1:1:2,128:0:528:1:1:4}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
SKIP=${SKIP:-}
if [[ $SKIP != *1* ]]; then
  echo "== 1. kernels_check --only v5 --quick-v5 ($(date -u +%T))"
  timeout ${T1:-60} python3 benchmarks/kernels_check.py --only v5 --quick-v5 --out "$OUT" 2>&1 | tee "$OUT/v5_check.log"
fi
if [[ $SKIP != *2* && -n $NCU ]]; then
  echo "== 2. kernel GPU time under ncu ($(date -u +%T))"
  timeout ${T2:-70} "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    --log-file "$OUT/ncu_times.csv" python3 benchmarks/kernel_time.py --contexts ${KT_CONTEXTS:-32768,131072} --reps 2 \
    --v5-configs "384:0:132:2:1,$CFGS" --schedule "$OUT/schedule.json" > "$OUT/kernel_time_run.log" 2>&1
  tail -2 "$OUT/kernel_time_run.log"
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_times.csv" --schedule "$OUT/schedule.json" \
    --json "$OUT/kernel_time.json" 2>&1 | tee "$OUT/kernel_time.md"
fi
if [[ $SKIP != *3* ]]; then
  echo "== 3. attention benchmark ($(date -u +%T))"
  timeout ${T3:-70} python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 16 --reps 10 \
    --contexts "${BENCH_CONTEXTS:-32768,131072}" --methods "=IsoQuant-3 v4 (one launch),v5" \
    --v5-configs "${BENCH_CFGS:-256:0:264:1:1:2}" --out "$OUT" 2>&1 | tee "$OUT/v5_bench.log" | grep -E "^\||FAILED|copy bandwidth"
fi
echo "== done ($(date -u +%T))"
