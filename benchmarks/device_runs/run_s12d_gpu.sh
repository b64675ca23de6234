#!/usr/bin/env bash
# Session 12, call 5 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): 384 threads with a one-slot
# ring, now with the merge's warps sharing slabs in two rounds (NSL = 6; call 4 had the rounds' merge, 7.4 us), against
# 256 threads with one and two slots; then 384 threads without the lo halves (NOLOQ, NOLOV: fp16 precision, a probe).
# Then kernels_check's quick v5 set on 384:1:1:2:1.
set -u
OUT=${OUT:-$PWD/s12d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
one() {  # $1 tag, $2 RQ_V5_DEFS, $3 NTH:MINB:BLOCKS:PF:VDEC:STAGE, then env assignments for the trace
  local tag=$1 defs=$2 cfg=$3; shift 3
  echo "== $tag ($(date -u +%T))"
  env RQ_V5_DEFS=$defs "$@" timeout 40 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 3 \
    > "$OUT/trace_$tag.txt" 2>&1
  grep -E "^== T|warp 0 loop end|partials written|numerators" "$OUT/trace_$tag.txt" | sed -E 's/\(runs[^)]*\)//; s/, blocks. starts.*//'
  RQ_V5_DEFS=$defs timeout 40 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$OUT/ncu_$tag.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
    --methods "v5 256" --v5-configs "$cfg" --schedule "$OUT/sched_$tag.json" > /dev/null 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_$tag.csv" --schedule "$OUT/sched_$tag.json" 2>&1 \
    | grep "^| [0-9]" | sed "s/^/$tag /" | tee -a "$OUT/ncu.txt"
  rm -f "$OUT/ncu_$tag.csv" "$OUT/sched_$tag.json"
}
one t384s1 NOPIPE 384:1:132:1:2:1 RQ_V5_MINB=1 RQ_V5_NTH=384 RQ_V5_STAGE=1
one t256s1 NOPIPE 256:1:132:1:2:1 RQ_V5_MINB=1 RQ_V5_STAGE=1
one t256s2 NOPIPE 256:1:132:1:2:2 RQ_V5_MINB=1
one t384s1_nolo NOPIPE,NOLOQ,NOLOV 384:1:132:1:2:1 RQ_V5_MINB=1 RQ_V5_NTH=384 RQ_V5_STAGE=1
echo "== check 384 ($(date -u +%T))"
RQ_V5_DEFS=NOPIPE timeout 120 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 384:1:1:2:1 \
  > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
echo "== done ($(date -u +%T))"
