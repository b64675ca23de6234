#!/usr/bin/env bash
# Session 9, call B (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590).
# 1. Where a launch's time goes: benchmarks/diag/v5_trace.py (phase stamps a block), the default and RQ_V5_MERGE=1.
# 2. session 8's prepared checks of the one-barrier merge (RQ_V5_MERGE=1): kernels_check's quick v5 set (with the 4-bit-key
#    cases), the cache's windowed path, then ncu MERGE 0 against 1 at 256 threads / 132 blocks, PF 2 and PF 1.
set -u
OUT=${OUT:-$PWD/s9_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for m in 0 1; do
  echo "== trace, MERGE $m ($(date -u +%T))"
  RQ_V5_MERGE=$m timeout 120 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 5 \
    --json "$OUT/trace_m$m.json" 2>&1 | grep -v Warning | tail -60
done
echo "== correctness, MERGE 1 ($(date -u +%T))"
RQ_V5_MERGE=1 timeout 90 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 256:1:1:2:2 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
RQ_V5_MERGE=1 RQ_CHECK_VERSIONS=v5 timeout 40 python3 benchmarks/v4_cache_check.py --context 5000 --window 32 \
  --steps 3 > "$OUT/cache.log" 2>&1; tail -1 "$OUT/cache.log"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for m in 0 1; do
  echo "== ncu, MERGE $m ($(date -u +%T))"
  RQ_V5_MERGE=$m timeout 90 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$OUT/ncu_$m.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
    --methods "v5 256" --v5-configs 256:2:132:1:2:2,256:1:132:1:2:2 \
    --schedule "$OUT/schedule_$m.json" > "$OUT/kt_$m.log" 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_$m.csv" --schedule "$OUT/schedule_$m.json" 2>&1 | tail -8
done
echo "== done ($(date -u +%T))"
