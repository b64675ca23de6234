#!/usr/bin/env bash
# Session 16, call 10 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): kv_decode writing into a
# buffer with room for the fp16 segment (no concatenated copy), checked again against float64; then long-prompt prefill
# with more layers, where the whole prompt's fp16 K/V (all layers) outweighs kv.prefill_fp16's one-layer transient:
# 16 layers at 32K, 8 layers at 128K (the Qwen3-30B-A3B shape; the real model has 48).
set -u
OUT=${OUT:-$PWD/s16c_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== decode_check ($(date -u +%T))"
timeout 100 python3 benchmarks/diag/decode_check.py > "$OUT/decode_check.log" 2>&1; echo "rc $?"; tail -1 "$OUT/decode_check.log"
echo "== sdpa_peak ($(date -u +%T))"
timeout 60 python3 benchmarks/diag/sdpa_peak.py --cache 2>&1 | tail -4
for spec in "16 2048,32768 250" "8 131072 190"; do  # 2,048 first: MLX's first-run compile lands there
  set -- $spec
  echo "== prefill_memory layers $1 context $2 ($(date -u +%T))"
  timeout $3 python3 benchmarks/prefill_memory.py --layers $1 --contexts $2 --json \
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
        print(f"L{d['layers']:>3} {r['context']:>7} {r['cache']:<45} prefill {r['prefill_s']:8.2f} s  peak +{r['peak_over_weights_bytes']/2**20:9.1f} MiB"
              f"  KV {r['kv_bytes']/2**20:8.1f} MiB")
PY
echo "== done ($(date -u +%T))"
