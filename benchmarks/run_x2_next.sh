#!/usr/bin/env bash
# The next session's device work in ONE call on the two-GPU machine (nvidia-h200-x2), after
# `bash .device/bin/gpu-stage-a` (carry .device/a, .device/bin):
#   run: bash benchmarks/run_x2_next.sh     timeout_s: 590
#   carry: [".device/b", ".device/bin", ".train/train_ids.npy", ".train/heldout_ids.npy", ".train/tokenizer.json",
#           ".train/tokens.json"]
# GPU 0: scripts/train_two_phase_gpu.sh (the needle-capable reference model: copy phase until induction,
#        then text + needles), ~9 min.
# GPU 1: benchmarks/run_window_gpu.sh (attn_v4w: fp16 window in v4's launch), then the v5 cp.async ring
#        (run_v5_gpu.sh steps 1, 2 and 4b: correctness, kernel-only ncu times, chained benchmark).
# Returns: train/p2/* (checkpoint shards), train/logs.tar, gpu1.tar (all GPU-1 logs in one file).
set -u
OUT=${OUT:-$PWD/x2_next}; mkdir -p "$OUT/train" "$OUT/g1"
source .device/bin/gpu-env || exit 3
( export CUDA_VISIBLE_DEVICES=0; OUT="$OUT/train" P1_BUDGET=${P1_BUDGET:-200} T1=${T1:-210} P2_BUDGET=${P2_BUDGET:-330} T2=${T2:-340} bash scripts/train_two_phase_gpu.sh > "$OUT/train/console.log" 2>&1 ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  OUT="$OUT/g1/window" bash benchmarks/run_window_gpu.sh > "$OUT/g1/window.log" 2>&1
  OUT="$OUT/g1/v5" SKIP=34 T1=120 T2=100 T4B=110 bash benchmarks/run_v5_gpu.sh > "$OUT/g1/v5.log" 2>&1 ) &
P1=$!
wait $P1; tar cf "$OUT/gpu1.tar" -C "$OUT" g1 && rm -rf "$OUT/g1"
wait $P0; mv "$OUT/train/console.log" "$OUT/train/console.txt"
echo "== GPU 0: training"; tail -25 "$OUT/train/console.txt"
echo "== GPU 1"; tar xOf "$OUT/gpu1.tar" g1/window.log | grep -vE "^ok " | tail -30
tar xOf "$OUT/gpu1.tar" g1/v5.log | tail -40
