#!/usr/bin/env bash
# Session 13, call 4 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the warps' (m, l) moved into
# the pair table's alignment padding (every configuration's layout changes; 512 threads now fit 48 KB), and 448 / 512
# threads a block (launch bound (n, 1): 128 registers). Correctness (quick v5 set with the 448 and 512 configurations,
# the windowed cache at 80,000 tokens at 512 threads), ncu at 4K / 32K / 64K / 128K for 256 / 384 / 448 / 512, the
# phase trace at 128K for 384 and 512, CUPTI busy a layer at 128K for 384 / 448 / 512.
set -u
OUT=${OUT:-$PWD/s13b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
echo "== check ($(date -u +%T))"
timeout 100 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 448:1:1:2:1,512:1:1:2:1 \
  > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
RQ_V5_NTH=512 RQ_CHECK_VERSIONS=v5 timeout 100 python3 benchmarks/v4_cache_check.py --context 80000 --window 32 \
  --rotation wht_so4 --steps 2 > "$OUT/cache_80000_512.log" 2>&1
echo "cache 80000 32 wht_so4 (512 threads): $(tail -1 "$OUT/cache_80000_512.log")"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
echo "== ncu by threads ($(date -u +%T))"
timeout 150 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu_nth.csv" \
  python3 benchmarks/kernel_time.py --contexts 4096,32768,65536,131072 --reps 3 \
  --methods "v5 256,v5 384,v5 448,v5 512" \
  --v5-configs 256:1:132:1:2:1,384:1:132:1:2:1,448:1:132:1:2:1,512:1:132:1:2:1 --schedule "$OUT/sched_nth.json" \
  > "$OUT/kt_nth.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu_nth.csv" --schedule "$OUT/sched_nth.json" 2>&1 | grep -E "^\| [0-9]"
for n in 384 512; do
  echo "== trace $n ($(date -u +%T))"
  RQ_V5_NTH=$n timeout 40 python3 benchmarks/diag/v5_trace.py --contexts 131072 --reps 3 > "$OUT/trace_$n.txt" 2>&1
  grep -v Warning "$OUT/trace_$n.txt" | tail -22
done
for n in 384 448 512; do
  echo "== CUPTI busy, $n threads ($(date -u +%T))"
  RQ_V5_NTH=$n timeout 60 python3 benchmarks/diag/chain_timeline.py --contexts 131072 --layers 64 --reps 3 \
    --methods "fp16,v5" --out "$OUT/busy_{T}.json" > "$OUT/busy_$n.log" 2>&1
  grep "^summary" "$OUT/busy_$n.log"; rm -f "$OUT"/busy_*.json
done
echo "== done ($(date -u +%T))"
