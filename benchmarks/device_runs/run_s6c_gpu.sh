#!/usr/bin/env bash
# Session 6, third timing call (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590):
# v5 with two score accumulators (SACC 2) and the launch bound (256, 2) as defaults, the window variant included.
#   1. kernels_check --only v5 (every single-launch case) with the defaults
#   2. the caches' GPU path with windows 0 / 32 / 128 (RQ_ATTN v4, v5)
#   3. ncu kernel-only: v5 default, v5 one accumulator, v5 without the bound (256:0:264:1:1:2), v5 + window 32,
#      at 4K, 32K, 128K
#   4. chained, 64 layers a evaluation: fp16, v4 + window 32, v5, v5 + window 32, v5 one accumulator
set -u
OUT=${OUT:-$PWD/s6c_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. kernels_check v5 ($(date -u +%T))"
timeout ${T1:-150} python3 benchmarks/kernels_check.py --only v5 --out "$L" > "$L/check.log" 2>&1
grep -E "FAIL|passed" "$L/check.log" | tail -6
echo "== 2. cache checks ($(date -u +%T))"
for cw in ${CACHE_CASES:-5000:0 5000:32 5000:128}; do
  RQ_CHECK_VERSIONS=v4,v5 timeout 60 python3 benchmarks/v4_cache_check.py --context ${cw%:*} --steps 3 \
    --window ${cw#*:} >> "$L/cache_check.log" 2>&1
done
echo "$(grep -c '^ok ' "$L/cache_check.log") ok, $(grep -c '^FAIL' "$L/cache_check.log") FAIL"; grep "^FAIL" "$L/cache_check.log" | head -3
echo "== 3. ncu ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout ${T3:-140} "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$L/ncu.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
  --methods "v5" --v5-configs 256:0:264:1:1:2 --schedule "$L/schedule.json" > "$L/kt.log" 2>&1
tail -2 "$L/kt.log"
python3 benchmarks/kernel_time.py --parse "$L/ncu.csv" --schedule "$L/schedule.json" --json "$OUT/kernel_time.json" \
  2>&1 | tee "$OUT/kernel_time.md"
gzip -f "$L"/*.csv
echo "== 4. chained, 64 layers ($(date -u +%T))"
M="=fp16 SDPA,=IsoQuant-3 v4 + fp16 window 32 (one launch),=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch),=IsoQuant-3 v5, one score accumulator"
timeout ${T4:-200} python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 10 --chain \
  --contexts 4096,32768,131072 --methods "$M" --out "$L/chain64" > "$L/chain64.log" 2>&1
grep -E "^\||FAILED|Error" "$L/chain64.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
