#!/usr/bin/env bash
# One device call: the copy-task diagnostic (sdpa / manual attention, eager / compiled), then append_check.
set -u
OUT=${OUT:-$PWD/diag_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for v in "--attn sdpa" "--attn manual" "--attn sdpa --compile"; do
  timeout 60 python3 benchmarks/diag/copy_task.py $v 2>&1 | tee -a "$OUT/copy_task.log" | grep -E "step (0|150|300) "
done
echo "== append_check ($(date -u +%T))"
timeout 240 python3 benchmarks/append_check.py --out "$OUT" > "$OUT/append_check.log" 2>&1; echo "append_check rc $?"
tail -40 "$OUT/append_check.log"
