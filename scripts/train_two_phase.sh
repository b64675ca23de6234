#!/usr/bin/env bash
# Train the bundled model's checkpoint in two phases (after `python3 scripts/build_corpus.py` and
# `python3 scripts/train_reference.py tokenize`; a GPU is needed for the budgets below):
#   1. copy task only (random spans of a 512-token alphabet repeated at varying offsets; batch 32 x 256 tokens,
#      constant lr) until the copy loss falls below STOP (2.5): induction has formed. The step at which it forms
#      varies between runs with the same seed, hence a stop rule, not a step count.
#   2. from those weights: text, needle rows (half) and copy rows (1/8, to keep the copy heads) at 2,048 tokens.
#
#   bash scripts/train_two_phase.sh [DIR]      # DIR/p1, DIR/p2 and their logs (default .train/tp)
#   rq quantize DIR/p2 --recipe shakespeare-moe -o rq_core/assets/default_model
#
# Environment: SEED (0), STOP (2.5), P1_BUDGET (250 s), P2_BUDGET (320 s), P1_ARGS / P2_ARGS (more options for
# train_reference.py train). A longer run continues from DIR/p2: train_reference.py train --init DIR/p2 ...
set -euo pipefail
cd "$(dirname "$0")/.."
D=${1:-.train/tp}; mkdir -p "$D"; SEED=${SEED:-0}
python3 scripts/train_reference.py train --out "$D/p1" --seed "$SEED" --seq-len 256 --batch 32 --steps 6000 \
  --probe-steps 12 --warmup 100 --schedule constant --keep last --stop-loss "${STOP:-2.5}" --log-every 50 \
  --eval-every 500 --val-tokens 8192 --copy-share 1.0 --copy-vocab 512 --copy-span 64 --needle-share 0 \
  --time-budget "${P1_BUDGET:-250}" --reserve 8 --no-compile ${P1_ARGS:-} 2>&1 | tee "$D/p1.log"
grep -q "stopping" "$D/p1.log" || echo "phase 1: induction did not form within the budget (phase 2 runs anyway)"
python3 scripts/train_reference.py train --out "$D/p2" --init "$D/p1" --seed "$SEED" --warmup 50 \
  --needle-share 0.5 --copy-share 0.125 --copy-vocab 512 --copy-span 64 --log-every 50 --eval-every 250 \
  --time-budget "${P2_BUDGET:-320}" --reserve 30 --no-compile ${P2_ARGS:-} 2>&1 | tee "$D/p2.log"
