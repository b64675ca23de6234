#!/usr/bin/env bash
# Session 12, call 9 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): call 8 found the shared
# slabs' read-modify-write costing 1.6 us (the second barrier nothing). NSL3: round 1 summed into the summing threads'
# registers, the other warps then overwrite the slabs (three barriers, no read-modify-write). Trace of 384 threads
# with and without it at 4K / 32K / 128K, then ncu kernel alone with it (384 and 256 threads).
set -u
OUT=${OUT:-$PWD/s12h_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for d in "" NSL3; do
  t=${d:-base}
  RQ_V5_DEFS=$d RQ_V5_NTH=384 timeout 40 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 2 \
    > "$OUT/trace_$t.txt" 2>&1
  echo "== $t"; grep -E "^== T|loops end|slabs|partials written|stored" "$OUT/trace_$t.txt" | sed -E 's/\(runs[^)]*\)//; s/, blocks. starts.*//'
done
RQ_V5_DEFS=NSL3 timeout 60 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" \
  python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 --methods "v5 2,v5 3" \
  --v5-configs 384:1:132:1:2:1,256:1:132:1:2:1 --schedule "$OUT/sched.json" > /dev/null 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu.csv" --schedule "$OUT/sched.json" 2>&1 | grep "^| [0-9]" | tee "$OUT/ncu.txt"
rm -f "$OUT/ncu.csv" "$OUT/sched.json"
echo "== done ($(date -u +%T))"
