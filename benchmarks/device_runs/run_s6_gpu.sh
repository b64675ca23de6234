#!/usr/bin/env bash
# Session 6 (2026-11-30): the fp16 window as one more split (attn_v4w / attn_v5w) and v5's new default
# configuration (256 threads, 2-slot cp.async ring, 264 blocks; STAGE 0 where the ring does not fit), checked
# and timed on the H200 in ONE device call after `bash .device/bin/gpu-stage-a` (carry .device/a, .device/bin):
#     run: bash benchmarks/device_runs/run_s6_gpu.sh      carry: [".device/b", ".device/bin"]     timeout_s: 590
#   1. kernels_check --only v5: every single-launch case (contexts 1 to 131072, G 1/4/8, d 64/128/256, 2-4 bits,
#      f16/bf16 queries, causal, no rotation, dense, three launches in a row) with the defaults
#   2. the caches' GPU path against float64 with fp16 windows 1, 32, 128 (RQ_ATTN = v4 and v5)
#   3. kernel-only GPU time (ncu) of v4, v4 + window 32, v5, v5 + window 32 and fp16 SDPA at 4K, 32K, 128K
#   4. µs per layer, 16 chained layers: the same methods
# Each step under its own limit; outputs in $OUT as few files.
set -u
OUT=${OUT:-$PWD/s6_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. kernels_check v5 ($(date -u +%T))"
if [ -z "${SKIP_CHECK:-}" ]; then
  timeout ${T1:-170} python3 benchmarks/kernels_check.py --only v5 --out "$L" > "$L/check.log" 2>&1
fi
grep -E "FAIL|passed" "$L/check.log" 2>/dev/null | tail -8
echo "== 2. cache checks ($(date -u +%T))"
for cw in ${CACHE_CASES:-5000:1 5000:32 5000:128 40000:32}; do
  RQ_CHECK_VERSIONS=v4,v5 timeout ${T2:-80} python3 benchmarks/v4_cache_check.py --context ${cw%:*} --steps 3 \
    --window ${cw#*:} >> "$L/cache_check.log" 2>&1
  echo "context ${cw%:*} window ${cw#*:}: $(grep -c '^ok ' "$L/cache_check.log") ok lines so far, $(grep -c '^FAIL' "$L/cache_check.log") FAIL"
done
grep -E "^FAIL" "$L/cache_check.log" | head -5
echo "== 3. ncu kernel times ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout ${T3:-170} "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$L/ncu.csv" python3 benchmarks/kernel_time.py --contexts ${KT_CONTEXTS:-4096,32768,131072} --reps 3 \
  --methods "fp16,v4,v5" --schedule "$L/schedule.json" > "$L/kernel_time_run.log" 2>&1
tail -2 "$L/kernel_time_run.log"
python3 benchmarks/kernel_time.py --parse "$L/ncu.csv" --schedule "$L/schedule.json" --json "$OUT/kernel_time.json" \
  2>&1 | tee "$OUT/kernel_time.md"
gzip -f "$L/ncu.csv"
echo "== 4. chained ($(date -u +%T))"
timeout ${T4:-160} python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 16 --reps 20 --chain \
  --contexts ${CONTEXTS:-4096,32768,131072} \
  --methods "=fp16 SDPA,=IsoQuant-3 v4 (one launch),=IsoQuant-3 v4 + fp16 window 32 (one launch),=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch)" \
  --out "$L" > "$L/bench.log" 2>&1
grep -E "^\||FAILED|copy bandwidth" "$L/bench.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
