#!/usr/bin/env bash
# Session 10, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): attn_v5's fixed cost,
# three changes A/B in one process each (RQ_V5_DEFS): ACQREL (the split counter as one acq_rel atomic, no
# sequentially consistent fences), PRELOAD (the query row's loads before the tables', table loops unrolled), NU8
# (the last block's numerators unrolled 8, not 16: less code to fetch). Phase trace and ncu kernel-alone for each,
# then kernels_check's quick v5 set with all three.
set -u
OUT=${OUT:-$PWD/s10b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for defs in "" ACQREL PRELOAD NU8 ACQREL,PRELOAD,NU8; do
  tag=${defs:-base}; tag=${tag//,/_}
  echo "== $tag ($(date -u +%T))"
  RQ_V5_DEFS=$defs timeout 30 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 3 \
    > "$OUT/trace_$tag.txt" 2>&1
  grep -v Warning "$OUT/trace_$tag.txt" | grep -E "^==|q rotated|q fragments|partials written|counted|weights|numerators|stored" \
    | sed -E 's/blocks on .*span/span/; s/\(runs.*//'
  RQ_V5_DEFS=$defs timeout 40 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$OUT/ncu_$tag.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
    --methods "v5 256" --v5-configs 256:2:132:1:2:2 --schedule "$OUT/sched_$tag.json" > /dev/null 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_$tag.csv" --schedule "$OUT/sched_$tag.json" 2>&1 \
    | grep "^| [0-9]" | sed "s/^/$tag /" | tee -a "$OUT/ncu.txt"
  rm -f "$OUT/ncu_$tag.csv" "$OUT/sched_$tag.json"
done
echo "== correctness, all three ($(date -u +%T))"
RQ_V5_DEFS=ACQREL,PRELOAD,NU8 timeout 60 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
echo "== done ($(date -u +%T))"
