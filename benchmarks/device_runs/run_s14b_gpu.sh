#!/usr/bin/env bash
# Session 14, call 4 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin):
# the four kernels with pair codebooks and with 4-bit keys (kernels_check --only four, --quick: the main shape at
# every context and the new cases), v5's quick set (its head-dim-64 pair case now taken), then `rq profile` on the
# bundled model with pair codebooks against the scalar default (the four kernels stage by stage).
set -u
OUT=${OUT:-$PWD/s14b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== four ($(date -u +%T))"
timeout 150 python3 benchmarks/kernels_check.py --only four --quick > "$OUT/check_four.log" 2>&1
grep -E "FAIL|passed|/p128|/k4" "$OUT/check_four.log" | tail -24
echo "== v5 quick ($(date -u +%T))"
timeout 90 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check_v5.log" 2>&1
grep -E "FAIL|passed|d= 64" "$OUT/check_v5.log" | tail -6
for pp in "" "--pair-points 128,32"; do
  echo "== profile [$pp] ($(date -u +%T))"
  timeout 120 python3 -m rq_cli.main profile --context 4K,32K --repeats 5 $pp --json > "$OUT/profile_${pp:+pair}.json" \
    2> "$OUT/profile_${pp:+pair}.err"
  python3 - "$OUT/profile_${pp:+pair}.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no JSON:", e); sys.exit(0)
print("backend", r["backend"], "path", r["attention_path"], "pair", r["pair_points"])
for x in r["results"]:
    print(x["context"], "step ms %.3f" % x["decode_step_ms"], "kernels us/layer",
          {k: round(v, 1) for k, v in x["kernels_per_layer_us"].items()}, x["strategy"])
PY
  tail -2 "$OUT/profile_${pp:+pair}.err"
done
echo "== done ($(date -u +%T))"
