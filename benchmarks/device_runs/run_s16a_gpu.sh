#!/usr/bin/env bash
# Session 16, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): a long prompt's prefill with
# kv.prefill_fp16 now that a prompt chunk attends to the compressed older tokens by decoding them for one fused
# attention call (was: the chunked float32 reference path), against the whole prompt in fp16 and the fp16 cache.
# 2,048 first: MLX's first-run compile lands on its rows. Then one layer's decoded prefill attention alone (peak).
set -u
OUT=${OUT:-$PWD/s16a_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== prefill_memory ($(date -u +%T))"
timeout ${PM_TIMEOUT:-300} python3 benchmarks/prefill_memory.py --layers 4 --contexts ${PM_CONTEXTS:-2048,8192,32768} \
  ${PM_ARGS:-} --json > "$OUT/prefill_memory.json" 2> "$OUT/prefill_memory.err"
echo "rc $?"; tail -3 "$OUT/prefill_memory.err"
echo "== prefill_memory 128K ($(date -u +%T))"
timeout ${PM_TIMEOUT2:-240} python3 benchmarks/prefill_memory.py --layers 4 --contexts 131072 ${PM_ARGS:-} --json \
  > "$OUT/prefill_memory_128k.json" 2> "$OUT/prefill_memory_128k.err"
echo "rc $?"; tail -3 "$OUT/prefill_memory_128k.err"
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("prefill_memory*.json")):
    try:
        d = json.loads(f.read_text())
    except Exception as e:
        print(f.name, "unreadable", e); continue
    for r in (d["rows"] if isinstance(d, dict) else d):
        print(f"{r['context']:>7} {r['cache']:<45} prefill {r['prefill_s']:8.2f} s  peak +{r['peak_over_weights_bytes']/2**20:9.1f} MiB"
              f"  KV {r['kv_bytes']/2**20:8.1f} MiB")
PY
echo "== done ($(date -u +%T))"
if [ -n "${SDPA_PEAK:-}" ]; then
  echo "== sdpa_peak ($(date -u +%T))"; timeout 120 python3 benchmarks/diag/sdpa_peak.py $SDPA_PEAK 2>&1 | tail -8
fi
