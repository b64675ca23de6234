#!/usr/bin/env bash
# Session 17, call 5 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the bounded prefill with each
# layer's decoded attention evaluated in rq_core (IsoQuantCache._attend_decoded) at the real layer count (48 layers of
# the Qwen3-30B-A3B shape at 32K) and at 128K (8 layers), against the whole prompt in fp16: is the bound the better
# default for long prompts?
set -u
OUT=${OUT:-$PWD/s17c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for spec in "48 2048,32768 330" "8 131072 200"; do  # 2,048 first: MLX's first-run compile lands there
  set -- $spec
  echo "== prefill_memory layers $1 context $2 ($(date -u +%T))"
  timeout $3 python3 benchmarks/prefill_memory.py --layers $1 --contexts $2 --skip-fp16 --json \
    > "$OUT/prefill_memory_L$1_T${2##*,}.json" 2> "$OUT/prefill_memory_L$1_T${2##*,}.err"
  echo "rc $?"; tail -3 "$OUT/prefill_memory_L$1_T${2##*,}.err"
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("prefill_memory_L*.json")):
    try:
        d = json.loads(f.read_text())
    except Exception as e:
        print(f.name, "unreadable", e); continue
    for r in d["rows"]:
        print(f"L{d['layers']:>3} {r['context']:>7} {r['cache']:<45} prefill {r['prefill_s']:8.2f} s  peak +{r['peak_over_weights_bytes']/2**20:9.1f} MiB")
PY
echo "== done ($(date -u +%T))"
