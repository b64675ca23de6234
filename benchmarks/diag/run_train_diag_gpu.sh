#!/usr/bin/env bash
# One device call: does the bundled model's architecture learn the copy task at its real size (plain
# loop), and does scripts/train_reference.py's loop learn it (copy rows only, eager)?
set -u
OUT=${OUT:-$PWD/diag_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
timeout 75 python3 benchmarks/diag/copy_task.py --real --vocab 4096 --steps 300 2>&1 | tee "$OUT/copy_real.log"
timeout 90 python3 scripts/train_reference.py train --out "$OUT/ck" --seq-len 256 --batch 16 --steps 300 \
  --probe-steps 3 --warmup 20 --log-every 50 --eval-every 100 --val-tokens 8192 --copy-share 1.0 \
  --needle-share 0 --time-budget 85 --reserve 5 --no-compile 2>&1 | tee "$OUT/train_copy.log"
python3 - <<'PY' 2>&1 | tee -a "$OUT/train_copy.log"
import json, os
p = os.path.join(os.environ.get("OUT", "diag_out"), "ck", "train_log.json")
d = json.load(open(p)) if os.path.exists(p) else {}
print("curve", [(c["step"], c["loss"]) for c in d.get("loss_curve", [])])
PY
