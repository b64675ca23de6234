#!/usr/bin/env bash
# Session 13, call 11 (run; RQ_V5_MULHI measured no faster and taken out of the source since) (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): RQ_V5_MULHI (the pair
# fields' right shifts as multiply-high: 35 SHF of the loop's ALU ops move to the FMA-heavy pipe as IMAD.HI; nvcc here
# 446 -> 447 instructions) against the default: correctness (quick v5 set with MULHI), ncu kernel alone with the pipes'
# utilization at 4K / 32K / 128K for 256 and 384 threads, CUPTI busy a layer at 128K and 32K.
set -u
OUT=${OUT:-$PWD/s13e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
source benchmarks/gpu_steps.sh
echo "== check MULHI ($(date -u +%T))"
RQ_V5_DEFS=MULHI timeout 100 python3 benchmarks/kernels_check.py --only v5 --quick-v5 --v5-configs 384:1:1:2:1 \
  > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -4
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
for defs in "" MULHI; do
  tag=${defs:-base}
  echo "== ncu $tag ($(date -u +%T))"
  RQ_V5_DEFS=$defs timeout 120 "$ncu" --clock-control none \
    --metrics gpu__time_duration.sum,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active \
    --csv --log-file "$OUT/ncu_$tag.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
    --methods "v5 256,v5 384" --v5-configs 256:1:132:1:2:1,384:1:132:1:2:1 --schedule "$OUT/sched_$tag.json" \
    > /dev/null 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_$tag.csv" --schedule "$OUT/sched_$tag.json" 2>&1 \
    | grep "^| [0-9]" | sed "s/^/$tag /"
  python3 - "$OUT/ncu_$tag.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
acc = collections.defaultdict(list)
for r in rows:
    if "attn_v5" in r.get("Kernel Name", "") and r["Metric Name"] != "gpu__time_duration.sum":
        acc[r["Metric Name"]].append(float(r["Metric Value"].replace(",", "")))
for k, v in acc.items():
    print(f"  {k}: per launch {', '.join(f'{x:.1f}' for x in v)}")
PY
  echo "== CUPTI busy $tag ($(date -u +%T))"
  RQ_V5_DEFS=$defs timeout 80 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 \
    --methods "fp16,v5" --out "$OUT/busy_{T}.json" > "$OUT/busy_$tag.log" 2>&1
  grep "^summary" "$OUT/busy_$tag.log"; rm -f "$OUT"/busy_*.json
done
echo "== done ($(date -u +%T))"
