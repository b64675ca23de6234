#!/usr/bin/env bash
# Session 7, device call 3 (right after call 2, machine warm; carry .device/b, .device/bin; timeout 590):
# where a chained layer's time goes outside v5's kernel.
#   1. chain_timeline: kernel durations and gaps on the GPU (CUPTI through torch.profiler) at 128K and 32K
#      (ran as one process a context; since then chain_timeline takes both contexts in one)
#   2. MLX's CUDA-graph knobs: the chain under MLX_USE_CUDA_GRAPHS=0 and with one graph per evaluation
#   3. launch_cost: null kernels with attn_v5's inputs / outputs / slice view (32K)
set -u
OUT=${OUT:-$PWD/s7b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== 1. chain timeline ($(date -u +%T))"
timeout 220 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 5 --methods "fp16,v5,v5 as written,v5w" \
  --out "$OUT/timeline_{T}.json" > "$OUT/timeline.log" 2>&1
grep "^summary" "$OUT/timeline.log"
echo "== 2. MLX graph knobs ($(date -u +%T))"
for envs in "MLX_USE_CUDA_GRAPHS=0" "MLX_MAX_OPS_PER_BUFFER=1000 MLX_MAX_MB_PER_BUFFER=1000000" "MLX_MAX_OPS_PER_BUFFER=20"; do
  echo "-- $envs"
  env $envs timeout 100 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 10 --chain \
    --contexts 4096,131072 --methods "=fp16 SDPA,=IsoQuant-3 v5 (one launch)" > "$OUT/knob.log" 2>&1
  grep -E "^T=|FAILED|Error" "$OUT/knob.log"; mv "$OUT/knob.log" "$OUT/knob_$(echo $envs | tr ' =' '_-').log"
done
echo "== 3. launch cost ($(date -u +%T))"
timeout 100 python3 benchmarks/diag/launch_cost.py --context 32768 --layers 64 --out "$OUT/launch_cost.json" \
  > "$OUT/launch_cost.log" 2>&1; grep "^|" "$OUT/launch_cost.log"
NS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NS:-none}"
echo "== done ($(date -u +%T))"
