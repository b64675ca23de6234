#!/usr/bin/env bash
# Session 13, call 6 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): what bounds v5's main loop at
# 128K, where 384 and 512 threads run it in the same time (~650 cycles a warp step per scheduler): Nsight Compute's
# pipe utilization, scheduler and warp-state sections and per-instruction stall sampling, 384 and 512 threads.
set -u
OUT=${OUT:-$PWD/s13c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for n in 384 512; do
  echo "== ncu profile, $n threads, 128K ($(date -u +%T))"
  timeout 150 "$NCU" --clock-control none -k regex:attn_v5 --launch-skip 1 --launch-count 1 --warp-sampling-interval 1 \
    --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section WarpStateStats \
    --section SourceCounters --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_fmaheavy.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_tensor.sum,smsp__inst_executed_pipe_xu.sum,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg \
    -o "$OUT/prof_$n" python3 benchmarks/kernel_time.py --contexts 131072 --reps 2 \
    --methods "v5 $n" --v5-configs $n:1:132:1:2:1 > "$OUT/prof_$n.log" 2>&1; tail -1 "$OUT/prof_$n.log"
  "$NCU" --import "$OUT/prof_$n.ncu-rep" --page details --csv > "$OUT/details_$n.csv" 2>&1
  "$NCU" --import "$OUT/prof_$n.ncu-rep" --page raw --csv > "$OUT/raw_$n.csv" 2>&1
  grep -E "pipe|Issue|Eligible|Active Warps|Warp Cycles|Bank|Executed Ipc|Issued Warp|No Eligible" "$OUT/details_$n.csv" \
    | cut -d, -f13- | head -40
  "$NCU" --import "$OUT/prof_$n.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$n.csv" 2>&1
  python3 benchmarks/diag/sass_buckets.py "$OUT/sass_$n.csv" 2>&1 | tail -6
  gzip -f "$OUT/sass_$n.csv" "$OUT/raw_$n.csv"; rm -f "$OUT/prof_$n.ncu-rep" "$OUT/prof_$n.log"
done
echo "== done ($(date -u +%T))"
