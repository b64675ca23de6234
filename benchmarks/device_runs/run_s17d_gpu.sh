#!/usr/bin/env bash
# Session 17, call 7 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the bounded prefill (now the
# default) with its decoded attention queued 1, 2 or 4 layers ahead of the one waited for (IsoQuantCache.
# prefill_inflight), against a wait each layer (0) and the whole prompt in fp16, 48 layers x 32K (call 5: 45.03 s
# +2,534 MiB against 39.14 s +6,622 MiB). Then (LAYERS8=1) 8 layers x 128K with 0 and ${INF:-2} (calls 8 and 9: 2, then 1).
set -u
OUT=${OUT:-$PWD/s17d_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
if [ "${LAYERS8:-0}" = 1 ]; then specs="8 131072 ${INF:-2} 250"; else specs="48 2048,32768 1,2,4 560"; fi
for spec in "$specs"; do  # 2,048 first: MLX's first-run compile lands there
  set -- $spec
  echo "== prefill_memory layers $1 context $2 inflight $3 ($(date -u +%T))"
  timeout $4 python3 benchmarks/prefill_memory.py --layers $1 --contexts $2 --skip-fp16 --inflight $3 --json \
    > "$OUT/prefill_memory_L$1_T${2##*,}.json" 2> "$OUT/prefill_memory_L$1_T${2##*,}.err"
  echo "rc $?"; cat "$OUT/prefill_memory_L$1_T${2##*,}.err" | grep -v '^gpu-env' | tail -12
done
echo "== done ($(date -u +%T))"
