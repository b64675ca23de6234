#!/usr/bin/env bash
# Session 12, call 4 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): more warps an SM?
# Call 3's probes: leaving out every table lookup (31% of the loop's instructions) saved only 14% at 128K, so the loop
# is not bound by the lookups' issue. Does the SM take more resident warps: (a) 264 blocks at the (256, 2) bound, the
# trace now reports the blocks resident an SM at once; (b) 384 threads (12 warps) with a one-slot ring (the per-warp
# scratch is gone, so it fits 48 KB); (c) 256 threads with a one-slot ring, the control for (b)'s shorter lead.
# All with NOPIPE (call 2's better variant). Then kernels_check's quick v5 set on (b).
set -u
OUT=${OUT:-$PWD/s12c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
export RQ_V5_DEFS=NOPIPE
one() {  # $1 tag, $2 NTH:MINB:BLOCKS:PF:VDEC:STAGE, then env assignments for the trace
  local tag=$1 cfg=$2; shift 2
  echo "== $tag ($(date -u +%T))"
  env "$@" timeout 40 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 3 > "$OUT/trace_$tag.txt" 2>&1
  grep -E "^== T|partials written|numerators" "$OUT/trace_$tag.txt" | sed -E 's/\(runs[^)]*\)//'
  timeout 40 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu_$tag.csv" \
    python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 --methods "v5 256" --v5-configs "$cfg" \
    --schedule "$OUT/sched_$tag.json" > /dev/null 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_$tag.csv" --schedule "$OUT/sched_$tag.json" 2>&1 \
    | grep "^| [0-9]" | sed "s/^/$tag /" | tee -a "$OUT/ncu.txt"
  rm -f "$OUT/ncu_$tag.csv" "$OUT/sched_$tag.json"
}
one base 256:1:132:1:2:2 RQ_V5_MINB=1
one b264 256:2:264:1:2:2 RQ_V5_MINB=2 RQ_V5_BLOCKS=264
one t384s1 384:1:132:1:2:1 RQ_V5_MINB=1 RQ_V5_NTH=384 RQ_V5_STAGE=1
one t256s1 256:1:132:1:2:1 RQ_V5_MINB=1 RQ_V5_STAGE=1
echo "== check 384 ($(date -u +%T))"
timeout 120 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 384:1:1:2:1 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
echo "== done ($(date -u +%T))"
