#!/usr/bin/env bash
# Session 9, call C (warm machine, right after run_s9_gpu.sh; carry .device/b, .device/bin; timeout 590): keys at
# their own width through the kernels (RQ_SPLIT_KERNELS=1) on the bundled model. rq eval ppl with 4-bit keys, kernels
# off (MLX ops append, reference attention) and on: equal ppl expected; then the gates and one seed's needles through
# the kernels (session 8's K4V3 set), as far as the call's time goes.
set -u
OUT=${OUT:-$PWD/s9c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
end=$(( $(date +%s) + 560 ))
left() { echo $(( end - $(date +%s) )); }
for sk in 1 0; do
  t0=$(date +%s.%N)
  RQ_SPLIT_KERNELS=$sk timeout $(( $(left) / 3 )) python3 -c "$R" eval ppl --kv isoquant3 --key-bits 4 --context 2048 \
    --windows 4 --json > "$OUT/ppl_k4_$sk.json" 2> "$OUT/ppl_k4_$sk.err"
  echo "RQ_SPLIT_KERNELS=$sk rc=$? wall $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s: $(head -c 300 "$OUT/ppl_k4_$sk.json")"
done
export RQ_SPLIT_KERNELS=1
echo "== gates ($(date -u +%T), $(left) s left)"
timeout $(( $(left) / 2 )) python3 -c "$R" eval gates --kv isoquant3 --key-bits 4 --json > "$OUT/gates_k4.json" 2> "$OUT/gates_k4.err"
echo "rc=$? $(head -c 600 "$OUT/gates_k4.json")"
echo "== needles, seed 2 ($(date -u +%T), $(left) s left)"
timeout $(( $(left) - 10 )) python3 -c "$R" eval niah --kv isoquant3 --key-bits 4 --lengths 512,1024,2048 \
  --depths 0.1,0.5,0.9 --trials 4 --seed 2 --json > "$OUT/niah_k4_s2.json" 2> "$OUT/niah_k4_s2.err"
echo "rc=$? $(head -c 400 "$OUT/niah_k4_s2.json")"
echo "== done ($(date -u +%T))"
