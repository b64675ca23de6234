#!/usr/bin/env bash
# Session 14, call 11 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): where the pair codebooks'
# extra time goes at 128K (38 against 32 us busy, with 8% more loop instructions): Nsight Compute's pipes, scheduler,
# warp states, shared wavefronts / bank conflicts and per-instruction stall sampling, pair against scalar (both at the
# defaults attention_v5 picks: 384 threads).
set -u
OUT=${OUT:-$PWD/s14f_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for m in "v5 pair" "v5"; do
  tag=${m// /_}
  echo "== ncu profile, $m, 128K ($(date -u +%T))"
  timeout 140 "$NCU" --clock-control none -k regex:attn_v5 --launch-skip 1 --launch-count 1 --warp-sampling-interval 1 \
    --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section WarpStateStats \
    --section SourceCounters --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_tensor.sum,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg,gpu__time_duration.sum \
    -o "$OUT/prof_$tag" python3 benchmarks/kernel_time.py --contexts 131072 --reps 2 --methods "$m" \
    > "$OUT/prof_$tag.log" 2>&1; tail -1 "$OUT/prof_$tag.log"
  "$NCU" --import "$OUT/prof_$tag.ncu-rep" --page details --csv > "$OUT/details_$tag.csv" 2>&1
  grep -E "Duration|pipe|Issue|Eligible|Active Warps|Warp Cycles|Bank|Executed Ipc|Issued Warp|No Eligible|Executed Instructions\"" \
    "$OUT/details_$tag.csv" | cut -d, -f13- | head -30
  "$NCU" --import "$OUT/prof_$tag.ncu-rep" --page raw --csv > "$OUT/raw_$tag.csv" 2>&1
  python3 - "$OUT/raw_$tag.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h, u, v = rows[0], rows[1], rows[2] if len(rows) > 2 else []
for k in ("gpu__time_duration.sum", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
          "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", "smsp__inst_executed_pipe_alu.sum",
          "smsp__inst_executed_pipe_fma.sum", "smsp__inst_executed_pipe_lsu.sum", "smsp__inst_executed.sum",
          "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active",
          "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"):
    if k in h: print(k, v[h.index(k)], u[h.index(k)])
PY
  "$NCU" --import "$OUT/prof_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$tag.csv" 2>&1
  python3 benchmarks/diag/sass_buckets.py "$OUT/sass_$tag.csv" 2>&1 | tail -8
  gzip -f "$OUT/sass_$tag.csv" "$OUT/raw_$tag.csv"; rm -f "$OUT/prof_$tag.ncu-rep"
done
echo "== done ($(date -u +%T))"
