#!/usr/bin/env bash
# The v4 measurement for the H200 (docs/KERNEL_NOTES.md, "v4: commands"), as ONE device call after
# call 1 (`bash .device/bin/gpu-stage-a`, carrying .device/a and .device/bin):
#     run: bash benchmarks/device_runs/run_v4_gpu.sh      carry: [".device/b", ".device/bin"]     timeout_s: 580
# Steps, each under its own time limit so later ones still run and print (~8 min in all, worst case):
#   1. kernels_check --only v4   correctness of attn_v4 against float64 math, outputs poisoned (<= 170 s)
#   2. v4_cache_check            the caches' RQ_ATTN=v3 / v3r / v4 paths against float64 math (<= 50 s)
#   3. attention.py              µs per layer: fp16 SDPA, v3 (default), TurboQuant-3, v4 (3 block targets)
#                                at 4K / 32K / 128K (<= 200 s)
#   4. attention.py at 32K, v4 only: 4 and 64 layers per evaluation, and 64 with one CUDA graph per
#      evaluation (MLX_MAX_OPS_PER_BUFFER=256): is MLX's ~25 µs per op paid per launch, per graph or
#      per evaluation? (<= 105 s)
# Logs and JSON go to $OUT (the device tool's output folder), or ./v4_out when $OUT is unset.
set -u
OUT=${OUT:-$PWD/v4_out}
mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$OUT/gpu.txt"
echo "== 1. kernels_check --only v4 ($(date -u +%T))"
timeout 170 python3 benchmarks/kernels_check.py --only v4 --out "$OUT" 2>&1 | tee "$OUT/v4_check.log"
echo "== 2. v4_cache_check ($(date -u +%T))"
timeout 50 python3 benchmarks/v4_cache_check.py --context 5000 --steps 2 2>&1 | tee "$OUT/v4_cache_check.log"
echo "== 3. attention benchmark ($(date -u +%T))"
timeout 200 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 16 --reps 20 \
  --methods "v4,=IsoQuant-3 fused,=TurboQuant-3 (dense)" --v4-blocks 132,528 --out "$OUT" 2>&1 \
  | tee "$OUT/v4_bench.log"
echo "== 4. is MLX's per-op cost per launch, per graph or per evaluation? v4 at 32K ($(date -u +%T))"
for run in "4 20" "64 20" "64 256"; do
  set -- $run  # layers per evaluation, MLX_MAX_OPS_PER_BUFFER (nodes per CUDA graph; 20 in the MLX source read)
  MLX_MAX_OPS_PER_BUFFER=$2 timeout 35 python3 benchmarks/attention.py --skip-threshold --skip-stages \
    --contexts 32768 --layers $1 --reps 10 --methods "=IsoQuant-3 v4 (one launch)" 2>&1 | grep -E "^T=" \
    | sed "s/^/layers=$1 ops_per_buffer=$2 /" | tee -a "$OUT/v4_layers.log"
done
echo "== done ($(date -u +%T))"
