#!/usr/bin/env bash
# Session 7, device call 4 (fresh machine: `bash .device/bin/gpu-stage-a` first; carry .device/b, .device/bin;
# timeout 590): the full table, every peer in one process.
#   1. attention.py: 64 chained layers a decode step, 4 steps queued back to back (--pipeline 4: rq generate's
#      loop), 4K / 32K / 128K: fp16 SDPA, two quantized matmuls 8- and 4-bit, TurboQuant-3 (its default path),
#      IsoQuant-3 four-kernel, v5, v5 + window 32 (the default)
#   2. chain_timeline at 32K and 128K: each method's GPU busy time a layer in the chain (CUPTI)
set -u
OUT=${OUT:-$PWD/s7c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== 1. attention table, pipelined decode steps ($(date -u +%T))"
timeout 330 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 5 --chain --pipeline 4 \
  --contexts 4096,32768,131072 \
  --methods "=fp16 SDPA,=qmm 8-bit,=qmm 4-bit,=TurboQuant-3 (dense),=IsoQuant-3 four-kernel,=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch)" \
  --out "$OUT/table" > "$OUT/table.log" 2>&1
grep -E "^T=|^\||FAILED|Error" "$OUT/table.log"
echo "== 2. GPU busy a layer in the chain ($(date -u +%T))"
timeout 220 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 --methods "fp16,qmm8,qmm4,turbo3,four,v5,v5w" \
  --out "$OUT/busy_{T}.json" > "$OUT/busy.log" 2>&1
grep "^summary" "$OUT/busy.log"
echo "== 3. ncu stall reasons of v5 at 128K, one launch ($(date -u +%T))"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout 150 "$NCU" --clock-control none -k regex:attn_v5 --launch-skip 1 --launch-count 1 \
  --section WarpStateStats --section SchedulerStats --section SourceCounters --section Occupancy \
  --section MemoryWorkloadAnalysis -o "$OUT/v5prof" python3 benchmarks/kernel_time.py --contexts 131072 --reps 2 \
  --methods "v5 sacc1" > "$OUT/v5prof.log" 2>&1; tail -3 "$OUT/v5prof.log"
"$NCU" --import "$OUT/v5prof.ncu-rep" --page details > "$OUT/v5prof_details.txt" 2>&1
"$NCU" --import "$OUT/v5prof.ncu-rep" --page source --csv --print-source sass > "$OUT/v5prof_sass.csv" 2>&1
grep -iE "stall|warp cycles per|issued|eligible|active warps" "$OUT/v5prof_details.txt" | head -30
gzip -f "$OUT"/v5prof_sass.csv
echo "== done ($(date -u +%T))"
