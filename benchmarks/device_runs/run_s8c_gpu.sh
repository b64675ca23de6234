#!/usr/bin/env bash
# Session 8, device call 5 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590):
# the pair decode as the default (VDEC 2) after two fixes found by call 2 (the window's block left the table
# address unset; an unused ring was dropped from the layout, so d = 256 missed the 8 KB alignment: NaN, loud).
#   1. correctness: kernels_check v5 (20 cases), cache paths (windows 0 / 32 at 5,000 tokens, 32 at 40,000,
#      rwht_so4), v4 unchanged
#   2. ncu, kernel alone: the default at 264 / 132 / 66 blocks, 4K / 32K / 128K (fixed cost against splits)
set -u
OUT=${OUT:-$PWD/s8c_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. correctness ($(date -u +%T))"
timeout 120 python3 benchmarks/kernels_check.py --only v5 --out "$L/v5" > "$L/check_v5.log" 2>&1
grep -E "FAIL|passed" "$L/check_v5.log" | tail -4
for args in "--context 5000 --window 0" "--context 5000 --window 32" "--context 40000 --window 32" \
            "--context 5000 --window 32 --rotation rwht_so4"; do
  tag=$(echo "$args" | tr -d ' -')
  RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py $args --steps 3 > "$L/cache_$tag.log" 2>&1
  echo "$args: $(tail -1 "$L/cache_$tag.log")"
done
echo "== 2. ncu, kernel alone ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout 200 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$L/ncu.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
  --methods "v5 256" --v5-configs 256:2:264:1:2:2,256:2:132:1:2:2,256:2:66:1:2:2,256:2:264:1:1:2 \
  --schedule "$L/schedule.json" > "$L/kt.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$L/ncu.csv" --schedule "$L/schedule.json" --json "$OUT/kernel_time.json" \
  2>&1 | tee "$OUT/kernel_time.md"
gzip -f "$L"/*.csv
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
