#!/usr/bin/env bash
# Session 13, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the merge's first round
# summed in registers (NSL3) as the default, 384 threads from 75K packed tokens. kernels_check's quick v5 set plus the
# 384-thread configuration, the windowed cache at 80,000 tokens (384 threads), ncu at 64K / 80K / 96K for the
# crossover, CUPTI busy a layer in the 64-layer chain beside fp16 SDPA.
set -u
OUT=${OUT:-$PWD/s13a_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
echo "== check ($(date -u +%T))"
timeout 90 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 384:1:1:2:1 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
RQ_CHECK_VERSIONS=v5 timeout 100 python3 benchmarks/v4_cache_check.py --context 80000 --window 32 --rotation wht_so4 \
  --steps 2 > "$OUT/cache_80000.log" 2>&1; echo "cache 80000 32 wht_so4: $(tail -1 "$OUT/cache_80000.log")"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
echo "== ncu crossover ($(date -u +%T))"
timeout 90 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu_x.csv" \
  python3 benchmarks/kernel_time.py --contexts 65536,81920,98304 --reps 3 --methods "v5 256,v5 384" \
  --v5-configs 256:1:132:1:2:1,384:1:132:1:2:1 --schedule "$OUT/sched_x.json" > /dev/null 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu_x.csv" --schedule "$OUT/sched_x.json" 2>&1 | tail -8
ncu_kernel_time "v5" ""
cupti_busy
echo "== done ($(date -u +%T))"
