#!/usr/bin/env bash
# Session 6, second timing call (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590):
#   1. the window's split planned inside v5's block target (no third wave) and split 0: cache check, context 5,000
#   2. ncu kernel-only times at 4K with windows 1, 32 and 128 (does the window block's cost follow its size?)
#      and at 128K (v5 against v5 + window 32 after the plan fix)
#   3. chained harness with 16 and 64 layers per evaluation (the per-evaluation fixed cost amortised)
set -u
OUT=${OUT:-$PWD/s6b_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
L=$OUT/logs
echo "== 1. cache check ($(date -u +%T))"
RQ_CHECK_VERSIONS=v4,v5 timeout 60 python3 benchmarks/v4_cache_check.py --context 5000 --steps 3 --window 32 \
  > "$L/cache_check.log" 2>&1
tail -1 "$L/cache_check.log"; grep -c "^ok" "$L/cache_check.log"
echo "== 2. ncu ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
KT_WINDOWS=1,128 timeout 110 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$L/ncu4k.csv" python3 benchmarks/kernel_time.py --contexts 4096 --reps 3 \
  --methods "v4,v5" --schedule "$L/schedule4k.json" > "$L/kt4k.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$L/ncu4k.csv" --schedule "$L/schedule4k.json" --json "$OUT/kernel_time_4k.json" \
  2>&1 | tee "$OUT/kernel_time.md"
timeout 80 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
  --log-file "$L/ncu128k.csv" python3 benchmarks/kernel_time.py --contexts 131072 --reps 3 \
  --methods "v5" --schedule "$L/schedule128k.json" > "$L/kt128k.log" 2>&1
python3 benchmarks/kernel_time.py --parse "$L/ncu128k.csv" --schedule "$L/schedule128k.json" \
  --json "$OUT/kernel_time_128k.json" 2>&1 | tail -2 | tee -a "$OUT/kernel_time.md"
gzip -f "$L"/*.csv
M="=fp16 SDPA,=IsoQuant-3 v4 (one launch),=IsoQuant-3 v4 + fp16 window 32 (one launch),=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch)"
for nl_ctx in ${CHAINS:-16:4096,32768,131072 64:4096,32768,131072}; do
  nl=${nl_ctx%%:*}; ctx=${nl_ctx#*:}
  echo "== 3. chained, $nl layers ($(date -u +%T))"
  mkdir -p "$L/chain$nl"
  timeout ${TC:-200} python3 benchmarks/attention.py --skip-threshold --skip-stages --layers $nl --reps 10 --chain \
    --contexts $ctx --methods "$M" --out "$L/chain$nl" > "$L/chain$nl.log" 2>&1
  grep -E "^\||FAILED|Error" "$L/chain$nl.log"
done
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
echo "== done ($(date -u +%T))"
