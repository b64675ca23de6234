#!/usr/bin/env bash
# One device call: how many steps does the real-size model need to form induction (copying a random
# span repeated at a varying offset, so a fixed-offset positional head cannot solve it)?
# run_train_diag_gpu.sh showed 400 steps are not enough (loss stays at ln 512), while a fixed offset is
# learned in 150 (benchmarks/diag/copy_task.py). Loss floor with induction ≈ 1.0 (the first span of
# each row, 16-64 of 256 tokens, cannot be predicted).
set -u
OUT=${OUT:-$PWD/diag_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
STEPS=${STEPS:-2500}
train() {  # $1 = name, $2 = time limit, rest = extra args
  local name=$1 lim=$2; shift 2
  echo "== $name ($(date -u +%T))"
  timeout "$lim" python3 scripts/train_reference.py train --out "$OUT/$name" --seq-len 256 --batch 16 \
    --steps "$STEPS" --probe-steps 3 --warmup 50 --log-every 100 --eval-every 500 --val-tokens 8192 \
    --time-budget 1000 --reserve 5 --no-compile "$@" 2>&1 | grep -v "^ *$" | tee "$OUT/$name.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('curve', [(c['step'], c['loss']) for c in d['loss_curve']])" \
    "$OUT/$name/train_log.json" 2>&1 | tee -a "$OUT/$name.log"
  rm -f "$OUT/$name"/*.safetensors "$OUT/$name"/tokenizer*.json
}
train r1_copy ${T1:-110} --copy-share 1.0 --copy-vocab 512 --copy-span 64 --needle-share 0
train r2_copy_8heads ${T2:-110} --copy-share 1.0 --copy-vocab 512 --copy-span 64 --needle-share 0 --heads 8
train r3_mix ${T3:-110} --copy-share 0.25 --copy-vocab 512 --copy-span 64 --needle-share 0.5
echo "== done ($(date -u +%T))"
