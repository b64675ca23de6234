#!/usr/bin/env bash
# Session 8, device call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590):
# attn_v5's pair decode (VDEC 2: keys and values through the lane-replicated pair table by byte offsets, the
# values' token pairs interleaved first; 597 SASS instructions a warp step against 777, nvcc 13 here).
#   1. correctness: kernels_check v5 with RQ_V5_VDEC=2 (20 cases), the cache's path (windows 0 and 32)
#   2. ncu, kernel alone, 4K / 32K / 128K: VDEC 1 against 2 (256 threads, bound 2, 264 blocks, ring 2)
#   3. decode-like timing (--pipeline 4, 64 chained layers): fp16 SDPA, v5 VDEC 1, v5 VDEC 2
set -u
OUT=${OUT:-$PWD/s8_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. correctness, VDEC 2 ($(date -u +%T))"
RQ_V5_VDEC=2 timeout 120 python3 benchmarks/kernels_check.py --only v5 --out "$L/v5" > "$L/check_v5_vd2.log" 2>&1
grep -E "FAIL|passed" "$L/check_v5_vd2.log" | tail -4
for w in 0 32; do
  RQ_V5_VDEC=2 RQ_CHECK_VERSIONS=v5 timeout 50 python3 benchmarks/v4_cache_check.py --context 5000 --steps 3 \
    --window $w > "$L/cache_vd2_w$w.log" 2>&1; tail -2 "$L/cache_vd2_w$w.log"
done
echo "== 2. ncu, kernel alone ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout 170 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$L/ncu.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
  --methods "v5 256" --v5-configs 256:2:264:1:1:2,256:2:264:1:2:2 --schedule "$L/schedule.json" > "$L/kt.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$L/ncu.csv" --schedule "$L/schedule.json" --json "$OUT/kernel_time.json" \
  2>&1 | tee "$OUT/kernel_time.md"
echo "== 3. pipelined decode steps ($(date -u +%T))"
timeout 200 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 5 --chain --pipeline 4 \
  --contexts 4096,32768,131072 --methods "=fp16 SDPA,IsoQuant-3 v5 256" \
  --v5-configs 256:2:264:1:1:2,256:2:264:1:2:2 --out "$L/pipe" > "$L/pipe.log" 2>&1
grep -E "^T=|^\||FAILED|Error" "$L/pipe.log"
gzip -f "$L"/*.csv
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
