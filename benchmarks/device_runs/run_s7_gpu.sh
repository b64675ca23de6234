#!/usr/bin/env bash
# Session 7, device call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590).
#   1. correctness with the minified sources (first NVRTC compile of them): kernels_check v5 (19 cases, a
#      rot = 11 one among them: rwht_so4's signs) and v4; v5 at the bound (256, 3); the caches' path with
#      rwht_so4 (windows 0 and 32, v4 and v5)
#   2. chained 64 layers, 4K / 32K / 128K: fp16, v5 (minified), v5 from the source as written, v5 + window,
#      v5 256/3/396 (three blocks an SM)
#   3. ncu, kernel alone: v5 256/2/264, 256/3/396, 256/3/264 at 32K and 128K
set -u
OUT=${OUT:-$PWD/s7_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. kernels_check, minified sources ($(date -u +%T))"
timeout 100 python3 benchmarks/kernels_check.py --only v5 --out "$L/v5" > "$L/check_v5.log" 2>&1
grep -E "FAIL|rot=11|passed" "$L/check_v5.log" | tail -4
timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 256:3:1:1:2 > "$L/check_lb3.log" 2>&1
grep -E "FAIL|passed" "$L/check_lb3.log" | tail -3
timeout 90 python3 benchmarks/kernels_check.py --only v4 > "$L/check_v4.log" 2>&1
grep -E "FAIL|rot=11|passed" "$L/check_v4.log" | tail -4
for w in 0 32; do
  RQ_CHECK_VERSIONS=v4,v5 timeout 50 python3 benchmarks/v4_cache_check.py --context 5000 --steps 3 --window $w \
    --rotation rwht_so4 > "$L/cache_rwht_w$w.log" 2>&1; tail -2 "$L/cache_rwht_w$w.log"
done
echo "== 2. chained, 64 layers ($(date -u +%T))"
timeout 220 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 10 --chain \
  --contexts 4096,32768,131072 --methods "=fp16 SDPA,=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5, source as written,=IsoQuant-3 v5 + fp16 window 32 (one launch),IsoQuant-3 v5 256" \
  --v5-configs 256:3:396:1:1:2 --out "$L/chain64" > "$L/chain64.log" 2>&1
grep -E "^T=|FAILED|Error" "$L/chain64.log"
echo "== 3. ncu ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout 130 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$L/ncu.csv" python3 benchmarks/kernel_time.py --contexts 32768,131072 --reps 3 \
  --methods "v5 256" --v5-configs 256:2:264:1:1:2,256:3:396:1:1:2,256:3:264:1:1:2 --schedule "$L/schedule.json" \
  > "$L/kt.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$L/ncu.csv" --schedule "$L/schedule.json" --json "$OUT/kernel_time.json" \
  2>&1 | tee "$OUT/kernel_time.md"
gzip -f "$L"/*.csv
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
