#!/usr/bin/env bash
# Session 17, call 3 (warm machine after run_s17a_gpu.sh; carry .device/bin): does evaluating each layer's decoded
# attention as it is built (sync: mx.eval, async: mx.async_eval) keep one layer's decoded K/V alive at a time in a
# bounded prefill? Session 16: bound 4096 at 16 layers x 32K peaked +4,521 MiB against the default's +3,448.
set -u
OUT=${OUT:-$PWD/s17b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== prefill_memory layers 16 ($(date -u +%T))"
# (--layer-eval was a wrapper in the script until d7ee393; the sync it measured is in rq_core since, and --inflight replaced it)
timeout 400 python3 benchmarks/prefill_memory.py --layers 16 --contexts 2048,32768 --layer-eval sync,async --skip-fp16 \
  --json > "$OUT/prefill_memory_L16.json" 2> "$OUT/prefill_memory_L16.err"; echo "rc $?"; tail -3 "$OUT/prefill_memory_L16.err"
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("prefill_memory_L*.json")):
    try:
        d = json.loads(f.read_text())
    except Exception as e:
        print(f.name, "unreadable", e); continue
    for r in d["rows"]:
        print(f"L{d['layers']:>3} {r['context']:>7} {r['cache']:<55} prefill {r['prefill_s']:8.2f} s  peak +{r['peak_over_weights_bytes']/2**20:9.1f} MiB")
PY
echo "== done ($(date -u +%T))"
