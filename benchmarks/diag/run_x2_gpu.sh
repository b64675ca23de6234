#!/usr/bin/env bash
# One call on the two-GPU machine (after gpu-stage-a): GPU 0 trains the real-size model on the
# variable-offset copy task for ~8 minutes (does induction form, and when? the weights are kept as a
# phase-1 init for the needle training); GPU 1 runs benchmarks/device_runs/run_v5_gpu.sh (v5's cp.async ring).
set -u
OUT=${OUT:-$PWD/x2_out}; mkdir -p "$OUT/ind" "$OUT/v5"
source .device/bin/gpu-env || exit 3
nvidia-smi -L
( export CUDA_VISIBLE_DEVICES=0
  timeout ${TI:-540} python3 scripts/train_reference.py train --out "$OUT/ind/ck" --seq-len 256 --batch 32 \
    --probe-steps 12 --warmup 100 --log-every 250 --eval-every 1000 --val-tokens 8192 --copy-share 1.0 \
    --copy-vocab 512 --copy-span 64 --needle-share 0 --time-budget ${IND_BUDGET:-480} --reserve 15 --no-compile \
    ${IND_ARGS:-} > "$OUT/ind/train.log" 2>&1
  cp "$OUT/ind/ck/train_log.json" "$OUT/ind/" 2>/dev/null
  rm -f "$OUT/ind/ck/tokenizer"*.json "$OUT/ind/ck/train_log".* "$OUT/ind/ck/generation_config.json" ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  OUT="$OUT/v5" SKIP=${V5_SKIP:-4} bash benchmarks/device_runs/run_v5_gpu.sh > "$OUT/v5/run.log" 2>&1 ) &
P1=$!
wait $P0 $P1
echo "== induction run"; grep -v "^ *$" "$OUT/ind/train.log" | tail -25
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('curve', [(c['step'], c['loss']) for c in d['loss_curve']])" \
  "$OUT/ind/train_log.json" 2>&1
echo "== v5"; cat "$OUT/v5/run.log" | tail -80
