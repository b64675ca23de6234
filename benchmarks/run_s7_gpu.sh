#!/usr/bin/env bash
# Prepared in session 6 for the next device call (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin;
# timeout 590): does v5 with THREE blocks per SM (launch bound (256, 3): nvcc 13 gives 80 registers, 204 bytes of
# spills, 825 instructions a warp step against 766; 24 warps an SM instead of 16) run faster? Prediction
# (docs/KERNEL_NOTES.md, "Session 6"): the kernel is latency-bound (issue floor 24 µs at 128K, measured 69), so
# 1.5x the warps should take 128K from 69 to ~50 µs kernel-only if the spills stay in L1.
#   1. kernels_check: v5 at 256:3:1:1:2 (kernels_check's NTH:MINB:PF:VDEC:STAGE) at 513 / 4096 / 32768
#   2. ncu: v5 default (256/2/264), 256/3/396, 256/3/264 at 32K and 128K
#   3. chained 64 layers: fp16, v5 default, v5 256/3/396 at 4K, 32K, 128K
set -u
OUT=${OUT:-$PWD/s7_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. kernels_check ($(date -u +%T))"
timeout 120 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 256:3:1:1:2 --out "$L" \
  > "$L/check.log" 2>&1
grep -E "FAIL|passed" "$L/check.log" | tail -5
echo "== 1b. rwht_so4 on the GPU: every v5 case (a rot = 11 one among them), the caches' path ($(date -u +%T))"
timeout 120 python3 benchmarks/kernels_check.py --only v5 > "$L/check_all.log" 2>&1
grep -E "FAIL|rot=11|passed" "$L/check_all.log" | tail -4
for w in 0 32; do
  RQ_CHECK_VERSIONS=v4,v5 timeout 60 python3 benchmarks/v4_cache_check.py --context 5000 --steps 3 --window $w \
    --rotation rwht_so4 2>&1 | tail -1
done
echo "== 2. ncu ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout 150 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$L/ncu.csv" python3 benchmarks/kernel_time.py --contexts 32768,131072 --reps 3 \
  --methods "v5 256" --v5-configs 256:2:264:1:1:2,256:3:396:1:1:2,256:3:264:1:1:2 --schedule "$L/schedule.json" \
  > "$L/kt.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$L/ncu.csv" --schedule "$L/schedule.json" --json "$OUT/kernel_time.json" \
  2>&1 | tee "$OUT/kernel_time.md"
gzip -f "$L"/*.csv
echo "== 3. chained, 64 layers ($(date -u +%T))"
timeout 200 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 10 --chain \
  --contexts 4096,32768,131072 --methods "=fp16 SDPA,=IsoQuant-3 v5 (one launch),IsoQuant-3 v5 256" \
  --v5-configs 256:3:396:1:1:2 --out "$L/chain64" > "$L/chain64.log" 2>&1
grep -E "^\||FAILED|Error" "$L/chain64.log"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
# 4. (if time is left) which part of a custom kernel's launch costs in a chain: inputs, outputs or the slice view
# timeout 120 python3 benchmarks/diag/launch_cost.py --context 32768 --layers 64 --out "$OUT/launch_cost.json"
