#!/usr/bin/env bash
# Session 8, device call 16 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 130):
# the warps' merge in one barrier (a slab a warp over the arena: pool, table and ring are one array now).
# Correctness (quick v5 set, the cache's windowed path), then ncu against call 14's default: 20.3 / 29.8 / 58.4 µs.
set -u
OUT=${OUT:-$PWD/s8i_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== correctness ($(date -u +%T))"
timeout 45 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
echo "== ncu ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout 50 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
  --log-file "$OUT/ncu.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
  --methods "v5 256" --v5-configs 256:2:132:1:2:2 --schedule "$OUT/schedule.json" > "$OUT/kt.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu.csv" --schedule "$OUT/schedule.json" 2>&1 | tee "$OUT/kernel_time.md"
echo "== cache, window 32 ($(date -u +%T))"
RQ_CHECK_VERSIONS=v5 timeout 30 python3 benchmarks/v4_cache_check.py --context 5000 --window 32 --steps 3 > "$OUT/cache.log" 2>&1
tail -1 "$OUT/cache.log"
echo "== done ($(date -u +%T))"
