#!/usr/bin/env bash
# One device call: does the bundled model's architecture learn the copy task at its real size (plain
# loop), and does scripts/train_reference.py's loop learn it (copy rows only, eager)? Both on a
# 512-token alphabet (the tiny model learns that in ~300 steps; 4,096 only starts by then).
# (c) is (b) without the router aux loss and gradient clipping, to bisect if (b) fails and (a) works.
set -u
OUT=${OUT:-$PWD/diag_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== a. plain loop, real size, vocab 512 ($(date -u +%T))"
timeout 80 python3 benchmarks/diag/copy_task.py --real --vocab 512 --steps 300 2>&1 | tee "$OUT/copy_real.log"
train() {  # $1 = name, rest = extra args
  local name=$1; shift
  echo "== $name ($(date -u +%T))"
  timeout 100 python3 scripts/train_reference.py train --out "$OUT/$name" --seq-len 256 --batch 16 --steps 400 \
    --probe-steps 3 --warmup 20 --log-every 50 --eval-every 100 --val-tokens 8192 --copy-share 1.0 \
    --copy-vocab 512 --copy-span 64 --needle-share 0 --time-budget 95 --reserve 5 --no-compile "$@" 2>&1 \
    | grep -v "^ *$" | tee "$OUT/$name.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('curve', [(c['step'], c['loss']) for c in d['loss_curve']])" \
    "$OUT/$name/train_log.json" 2>&1 | tee -a "$OUT/$name.log"
}
train b_script
train c_noaux_noclip --aux-coef 0 --clip 1e9
echo "== done ($(date -u +%T))"
