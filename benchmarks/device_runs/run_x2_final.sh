#!/usr/bin/env bash
# Last device call of session 5 on nvidia-h200-x2, after `bash .device/bin/gpu-stage-a`:
#   run: bash benchmarks/device_runs/run_x2_final.sh    timeout_s: 590
#   carry: [".device/b", ".device/bin", ".train/train_ids.npy", ".train/heldout_ids.npy", ".train/tokenizer.json",
#           ".train/tokens.json", ".train/xfer"]
# GPU 0: phase 2 continues from the first call's checkpoint (held-out ppl 72.1, needles 0.84 at 2048), which
#        travels 5-bit (scripts/ckpt_transfer.py: the working tree cap), for P2 seconds at lr 1e-3.
# GPU 1: kernel-only GPU time (ncu) of v4 and v4 + a 32-token window at 4K and 128K: does the window's
#        ~15-20 µs per layer in the chained harness come from the kernel or from MLX's dispatch?
set -u
OUT=${OUT:-$PWD/x2_final}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
( export CUDA_VISIBLE_DEVICES=0
  python3 scripts/ckpt_transfer.py unpack .train/xfer /tmp/tp/p2 > "$OUT/logs/a.log" 2>&1
  env OUT="$OUT/a" D=/tmp/tp RESUME=1 T2=${T2:-545} P2_BUDGET=${P2:-530} P2_ARGS="--lr 1e-3 --warmup 100" \
    bash scripts/train_two_phase_gpu.sh >> "$OUT/logs/a.log" 2>&1 ) &
P0=$!
( export CUDA_VISIBLE_DEVICES=1
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  echo "ncu: $NCU"
  timeout 200 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    --log-file "$OUT/logs/ncu_window.csv" python3 benchmarks/kernel_time.py --contexts 4096,131072 --reps 3 \
    --methods "v4" --schedule "$OUT/logs/schedule.json" > "$OUT/logs/kernel_time_run.log" 2>&1
  tail -3 "$OUT/logs/kernel_time_run.log"
  python3 benchmarks/kernel_time.py --parse "$OUT/logs/ncu_window.csv" --schedule "$OUT/logs/schedule.json" \
    --json "$OUT/logs/kernel_time.json" 2>&1
  echo "== chained, again ($(date -u +%T))"
  timeout 60 python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 16 --reps 20 --chain \
    --contexts 4096,131072 \
    --methods "=IsoQuant-3 v4 (one launch),=IsoQuant-3 v4 + fp16 window 32 (one launch)" --out "$OUT/logs" 2>&1 \
    | grep -E "^\||FAILED|copy bandwidth"
) > "$OUT/logs/window.log" 2>&1 &
P1=$!
wait $P0 $P1
tar cf "$OUT/logs.tar" -C "$OUT" logs && rm -rf "$OUT/logs"
tar xOf "$OUT/logs.tar" logs/a.log | tail -16
tar xOf "$OUT/logs.tar" logs/window.log
