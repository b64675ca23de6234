#!/usr/bin/env bash
# Session 12, call 6 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the new default (one ring
# slot; half queries -> single fp16 operands for the query and the weights, HALFOP; no PIPE, no scratch) at 256
# threads, against 384 threads (one slot, shared slabs) and 256 threads with two slots: trace + ncu kernel alone.
# Then every v5 correctness case on the default, the quick set on 384 threads and 2 slots, and the caches' checks.
set -u
OUT=${OUT:-$PWD/s12e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
one() {  # $1 tag, $2 NTH:MINB:BLOCKS:PF:VDEC:STAGE, then env assignments for the trace
  local tag=$1 cfg=$2; shift 2
  echo "== $tag ($(date -u +%T))"
  env "$@" timeout 40 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 3 > "$OUT/trace_$tag.txt" 2>&1
  grep -E "^== T|warp 0 loop end|partials written|numerators" "$OUT/trace_$tag.txt" | sed -E 's/\(runs[^)]*\)//; s/, blocks. starts.*//'
  timeout 40 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu_$tag.csv" \
    python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 --methods "v5 2,v5 3" --v5-configs "$cfg" \
    --schedule "$OUT/sched_$tag.json" > /dev/null 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_$tag.csv" --schedule "$OUT/sched_$tag.json" 2>&1 \
    | grep "^| [0-9]" | grep "v5 $(echo "$cfg" | tr : /) " | sed "s/^/$tag /" | tee -a "$OUT/ncu.txt"
  rm -f "$OUT/ncu_$tag.csv" "$OUT/sched_$tag.json"
}
one d256s1 256:1:132:1:2:1
one d384s1 384:1:132:1:2:1 RQ_V5_MINB=1 RQ_V5_NTH=384
one d256s2 256:1:132:1:2:2 RQ_V5_STAGE=2
echo "== correctness ($(date -u +%T))"
timeout 150 python3 benchmarks/kernels_check.py --only v5 --v5-configs 384:1:1:2:1,256:1:1:2:2 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
for a in "5000 32 wht_so4" "40000 32 wht_so4" "5000 0 rwht_so4"; do
  set -- $a
  RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context $1 --window $2 --rotation $3 \
    --steps 3 > "$OUT/cache_$1_$2_$3.log" 2>&1; echo "cache $a: $(tail -1 "$OUT/cache_$1_$2_$3.log")"
done
cat "$OUT"/cache_*.log > "$OUT/cache.log"; rm -f "$OUT"/cache_*.log
echo "== done ($(date -u +%T))"
