#!/usr/bin/env bash
# attn_v5 on the H200 in ONE device call (after `bash .device/bin/gpu-stage-a` carrying .device/a and .device/bin):
#     run: bash benchmarks/device_runs/run_v5_gpu.sh      carry: [".device/b", ".device/bin"]     timeout_s: 400
# Steps, each under its own time limit (docs/KERNEL_NOTES.md, "v5"):
#   1. kernels_check --only v5 (+ extra thread/launch-bound configurations): correctness against float64
#   2. GPU time of the kernels alone (ncu --clock-control none: gpu__time_duration, DRAM bytes), v4 vs v5
#      configurations vs fp16 SDPA (benchmarks/kernel_time.py)
#   3. ncu sections (speed of light, occupancy, warp stall reasons, memory) of v4 and v5 at 128K
#   4. attention.py: µs per layer with MLX's dispatch (16 layers per evaluation), then with --chain
#      (each layer's query = the previous layer's output, as in a decode step)
#   5. the caches' RQ_ATTN=v4 / v5 paths against float64 math (v4_cache_check.py)
# SKIP="4" skips the independent-layers benchmark, "b" the chained one.
# Env: V5_CFGS (NTH:MINB:BLOCKS:PF:VDEC:STAGE,...), CONTEXTS, SKIP (steps to skip, e.g. "3"),
# CHECK_CFGS (NTH:MINB:PF:VDEC:STAGE,...).
set -u
OUT=${OUT:-$PWD/v5_out}
mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
CFGS=${V5_CFGS:-256:0:264:1:1:2,128:0:528:1:1:4,256:0:264:1:1:0,384:0:132:2:0:0}
CHECK_CFGS=${CHECK_CFGS:-256:0:1:1:2,128:0:1:1:4}
CONTEXTS=${CONTEXTS:-32768,131072}
SKIP=${SKIP:-}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$OUT/gpu.txt"
echo "ncu: ${NCU:-none}"
if [[ $SKIP != *1* ]]; then
  echo "== 1. kernels_check --only v5 ($(date -u +%T))"
  timeout ${T1:-150} python3 benchmarks/kernels_check.py --only v5 --v5-configs "$CHECK_CFGS" --out "$OUT" 2>&1 \
    | tee "$OUT/v5_check.log" | grep -v "^ok "
  tail -1 "$OUT/v5_check.log"
fi
if [[ $SKIP != *2* && -n $NCU ]]; then
  echo "== 2. kernel GPU time under ncu ($(date -u +%T))"
  timeout ${T2:-110} "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    --log-file "$OUT/ncu_times.csv" python3 benchmarks/kernel_time.py --contexts "$CONTEXTS" --reps 3 \
    --v5-configs "384:0:132:2:1:0,$CFGS" --schedule "$OUT/schedule.json" > "$OUT/kernel_time_run.log" 2>&1
  tail -3 "$OUT/kernel_time_run.log"
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_times.csv" --schedule "$OUT/schedule.json" \
    --json "$OUT/kernel_time.json" 2>&1 | tee "$OUT/kernel_time.md"
fi
if [[ $SKIP != *3* && -n $NCU ]]; then
  echo "== 3. ncu sections at 128K ($(date -u +%T))"
  timeout ${T3:-70} "$NCU" --clock-control none -k regex:rq_attn_v --launch-skip 0 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 benchmarks/kernel_time.py --contexts 131072 --reps 1 --methods "v4,v5 384/0/132/2/1/0,${S3CFG:-v5 256/0/264/1/1/2}" \
    --v5-configs "384:0:132:2:1:0,$CFGS" > "$OUT/ncu_sections.txt" 2>&1
  grep -E "custom_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Stall|Warp Cycles Per Issued|Issued Ipc|L1/TEX Hit|Mem Pipes|Block Limit|stalled|Registers|Executed Ipc|Busy" \
    "$OUT/ncu_sections.txt" | grep -vE " 0(\.0+)?$" | head -200
fi
if [[ $SKIP != *5* ]]; then
  echo "== 5. cache path RQ_ATTN=v4/v5 ($(date -u +%T))"
  RQ_CHECK_VERSIONS=v4,v5 timeout ${T5:-50} python3 benchmarks/v4_cache_check.py --context 5000 --steps 2 2>&1 \
    | tee "$OUT/v5_cache_check.log" | grep -v "^ok "
fi
if [[ $SKIP != *4* ]]; then
  echo "== 4. attention benchmark ($(date -u +%T))"
  timeout ${T4:-150} python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 16 --reps 20 \
    --contexts "${BENCH_CONTEXTS:-4096,32768,131072}" --methods "=IsoQuant-3 v4 (one launch),v5" --v5-configs "$CFGS" \
    --out "$OUT" 2>&1 | tee "$OUT/v5_bench.log" | grep -E "^\||FAILED|copy bandwidth"
fi
if [[ $SKIP != *b* ]]; then
  echo "== 4b. attention benchmark, chained layers ($(date -u +%T))"
  mkdir -p "$OUT/chain"
  timeout ${T4B:-120} python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 16 --reps 20 --chain \
    --contexts "${BENCH_CONTEXTS:-4096,32768,131072}" --methods "=IsoQuant-3 v4 (one launch),v5" --v5-configs "$CFGS" \
    --out "$OUT/chain" 2>&1 | tee "$OUT/v5_bench_chain.log" | grep -E "^\||FAILED"
fi
echo "== done ($(date -u +%T))"
