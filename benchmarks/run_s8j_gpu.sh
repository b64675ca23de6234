#!/usr/bin/env bash
# Prepared in session 8 (not run; after run_s8i_gpu.sh has shown RQ_SPLIT_KERNELS correct, on the warm machine;
# carry .device/b, .device/bin; timeout 590): 4-bit keys with 3-bit values (K4V3) through the GPU kernels on the
# bundled model: the 72 paired needles of benchmarks/niah_bits.py's CPU runs (seeds 2 and 3, 4 a cell: the CPU
# gave 64 of 72 for K4V3, fp16 66) and the twelve gates, for issue 6's needle must-show on the GPU path.
set -u
OUT=${OUT:-$PWD/s8j_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
export RQ_SPLIT_KERNELS=1
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
for seed in 2 3; do
  echo "== needles, seed $seed ($(date -u +%T))"
  timeout 200 python3 -c "$R" eval niah --kv isoquant3 --key-bits 4 --lengths 512,1024,2048 --depths 0.1,0.5,0.9 \
    --trials 4 --seed $seed --json > "$OUT/niah_k4_s$seed.json" 2> "$OUT/niah_k4_s$seed.err"
  echo "rc=$? $(head -c 400 "$OUT/niah_k4_s$seed.json")"
done
echo "== gates ($(date -u +%T))"
timeout 150 python3 -c "$R" eval gates --kv isoquant3 --key-bits 4 --json > "$OUT/gates_k4.json" 2> "$OUT/gates_k4.err"
echo "rc=$? $(head -c 600 "$OUT/gates_k4.json")"
echo "== done ($(date -u +%T))"
