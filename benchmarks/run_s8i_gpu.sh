#!/usr/bin/env bash
# Prepared in session 8 for the next device call (after `bash .device/bin/gpu-stage-a`; carry .device/b,
# .device/bin; timeout 590; not run: the session's device time ran out): the warps' merge in one barrier
# (RQ_V5_MERGE=1: a slab a warp over the arena of pool, table and ring; CPU executor only so far).
# Correctness with it (quick v5 set, the cache's windowed path), then ncu, MERGE 0 against 1 (call 14's default:
# 20.3 / 29.8 / 58.4 µs at 4K / 32K / 128K), each also with the bound (256, 1) (one block an SM at 132 blocks
# needs no 128-register cap: nvcc gives 167 registers, 581 loop instructions) and at 264 blocks (two an SM: with
# the merge cheaper, more warps may pay at 128K). Make the fastest correct one the default.
# Then keys at their own width through the kernels (RQ_SPLIT_KERNELS=1; kernels_check's quick set above has the
# 4-bit-key cases): rq eval ppl with 4-bit keys, kernels off and on (equal ppl expected; the wall time).
set -u
OUT=${OUT:-$PWD/s8i_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== correctness, MERGE 1 ($(date -u +%T))"
RQ_V5_MERGE=1 timeout 80 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 256:1:1:2:2 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
RQ_V5_MERGE=1 RQ_CHECK_VERSIONS=v5 timeout 40 python3 benchmarks/v4_cache_check.py --context 5000 --window 32 \
  --steps 3 > "$OUT/cache.log" 2>&1; tail -1 "$OUT/cache.log"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for m in 0 1; do
  echo "== ncu, MERGE $m ($(date -u +%T))"
  RQ_V5_MERGE=$m timeout 90 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$OUT/ncu_$m.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
    --methods "v5 256" --v5-configs 256:2:132:1:2:2,256:1:132:1:2:2,256:2:264:1:2:2 \
    --schedule "$OUT/schedule_$m.json" > "$OUT/kt_$m.log" 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_$m.csv" --schedule "$OUT/schedule_$m.json" 2>&1 | tail -10
done
echo "== keys at their own width through the kernels: RQ_SPLIT_KERNELS 0 (ops append, reference attention) / 1 ($(date -u +%T))"
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
for sk in 0 1; do
  t0=$(date +%s.%N)
  RQ_SPLIT_KERNELS=$sk timeout 150 python3 -c "$R" eval ppl --kv isoquant3 --key-bits 4 --context 2048 --windows 4 \
    --json > "$OUT/ppl_k4_$sk.json" 2> "$OUT/ppl_k4_$sk.err"
  echo "RQ_SPLIT_KERNELS=$sk rc=$? wall $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s: $(head -c 300 "$OUT/ppl_k4_$sk.json")"
done
echo "== done ($(date -u +%T))"
