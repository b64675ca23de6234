#!/usr/bin/env bash
# Two-GPU device work in ONE call on nvidia-h200-x2, after `bash .device/bin/gpu-stage-a` (carry .device/a,
# .device/bin):
#   run: bash benchmarks/device_runs/run_x2_next.sh     timeout_s: 590
#   carry: [".device/b", ".device/bin", ".train/train_ids.npy", ".train/heldout_ids.npy", ".train/tokenizer.json",
#           ".train/tokens.json"]
# First call: GPU 0 trains the reference model in two phases (scripts/train_two_phase_gpu.sh, seed 0: copy
# task until induction forms, then text + needles); GPU 1 checks and times attn_v4w (the fp16 window in
# v4's launch) on contexts 5,000 and 40,000, then trains the same way with seed 1 (a second draw of the
# copy phase, whose end varies from run to run).
# RESUME=1, issued while the machine is still warm (it is held ~30 s after a call): both GPUs continue
# phase 2 from their /tmp checkpoints (lr 1e-3 unless P2_ARGS says otherwise).
# Returns a/p2/* and b/p2/* (two shards + meta.tar each) and logs.tar: 7 files (the device returns 8 at most).
set -u
OUT=${OUT:-$PWD/x2_next}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
export RESUME=${RESUME:-0}
if [[ $RESUME == 1 ]]; then
  PA="P1_BUDGET=0 T2=${T2R:-545} P2_BUDGET=${P2R:-530}"; PB=$PA
  export P2_ARGS=${P2_ARGS:---lr 1e-3 --warmup 100}
else
  PA="P1_BUDGET=200 T1=210 P2_BUDGET=330 T2=340"; PB="P1_BUDGET=170 T1=180 P2_BUDGET=260 T2=270"
fi
( export CUDA_VISIBLE_DEVICES=0
  env OUT="$OUT/a" D=/tmp/tp SEED=0 $PA bash scripts/train_two_phase_gpu.sh > "$OUT/logs/a.log" 2>&1 ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  if [[ $RESUME == 0 ]]; then
    for ctx in 5000 40000; do
      echo "== cache check: context $ctx, window 32 ($(date -u +%T))"
      RQ_CHECK_VERSIONS=v4 timeout 70 python3 benchmarks/v4_cache_check.py --context $ctx --steps 3 --window 32 2>&1 \
        | grep -v "^ok "
    done
    echo "== attention, chained ($(date -u +%T))"
    timeout 60 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 16 --reps 20 --chain \
      --contexts 4096,32768,131072 \
      --methods "=IsoQuant-3 v4 (one launch),=IsoQuant-3 v4 + fp16 window 32 (one launch)" --out "$OUT/logs" 2>&1 \
      | grep -E "^\||FAILED|copy bandwidth"
    echo "== done ($(date -u +%T))"
  fi > "$OUT/logs/window.log" 2>&1
  env OUT="$OUT/b" D=/tmp/tp1 SEED=1 $PB bash scripts/train_two_phase_gpu.sh > "$OUT/logs/b.log" 2>&1 ) &
P1=$!
wait $P0 $P1
tar cf "$OUT/logs.tar" -C "$OUT" logs && rm -rf "$OUT/logs"
for x in a b; do echo "== $x"; tar xOf "$OUT/logs.tar" logs/$x.log | tail -14; done
tar xOf "$OUT/logs.tar" logs/window.log
