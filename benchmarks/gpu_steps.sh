# Steps the device scripts share (source it after .device/bin/gpu-env; each step writes under $OUT and prints a
# summary). Kept in one place so a device call's script reads as the list of what it ran.

# kernels_check v5 (every case, plus a config) and the cache's paths: windowed at 5,000 and 40,000 tokens, rwht_so4
v5_correctness() {
  echo "== correctness ($(date -u +%T))"
  timeout 150 python3 benchmarks/kernels_check.py --only v5 --v5-configs 256:1:1:2:2 > "$OUT/check.log" 2>&1
  grep -E "FAIL|passed" "$OUT/check.log" | tail -4
  local a
  for a in "5000 32 wht_so4" "40000 32 wht_so4" "5000 0 rwht_so4"; do
    set -- $a
    RQ_CHECK_VERSIONS=v5 timeout 60 python3 benchmarks/v4_cache_check.py --context $1 --window $2 --rotation $3 \
      --steps 3 > "$OUT/cache_$1_$2_$3.log" 2>&1; echo "cache $a: $(tail -1 "$OUT/cache_$1_$2_$3.log")"
  done
  cat "$OUT"/cache_*.log > "$OUT/cache.log"; rm -f "$OUT"/cache_*.log
}

# where a v5 launch's time goes (benchmarks/diag/v5_trace.py)
v5_phase_trace() {
  echo "== trace ($(date -u +%T))"
  timeout 100 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 5 > "$OUT/trace.txt" 2>&1
  grep -v Warning "$OUT/trace.txt" | tail -45
}

# kernel alone under ncu: $1 methods, $2 v5 configurations
ncu_kernel_time() {
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  echo "== ncu ($(date -u +%T))"
  timeout 120 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$OUT/ncu.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
    --methods "$1" --v5-configs "$2" --schedule "$OUT/schedule.json" > "$OUT/kt.log" 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu.csv" --schedule "$OUT/schedule.json" 2>&1 | tail -11
  rm -f "$OUT/kt.log"
}

# GPU busy a layer in a 64-layer chain (CUPTI), fp16 SDPA and v5, 128K and 32K
cupti_busy() {
  echo "== CUPTI busy a layer ($(date -u +%T))"
  timeout 120 python3 benchmarks/diag/chain_timeline.py --contexts 131072,32768 --layers 64 --reps 3 \
    --methods "fp16,v5" --out "$OUT/busy_{T}.json" > "$OUT/busy.log" 2>&1
  grep "^summary" "$OUT/busy.log"
  rm -f "$OUT"/busy_*.json
}

# every peer in one process, decode-like (benchmarks/README.md's table): $1 timeout in seconds
peer_table() {
  echo "== table ($(date -u +%T))"
  mkdir -p "$OUT/table"
  timeout "$1" python3 benchmarks/attention.py --skip-threshold --skip-stages --layers 64 --reps 5 --chain \
    --pipeline 4 --contexts 4096,32768,131072 \
    --methods "=fp16 SDPA,=qmm 8-bit,=qmm 4-bit,=TurboQuant-3 (dense),=IsoQuant-3 four-kernel,=IsoQuant-3 v5 (one launch),=IsoQuant-3 v5 + fp16 window 32 (one launch),=IsoQuant-3 v5 pair codebooks (one launch),=IsoQuant-3 four-kernel pair codebooks" \
    --out "$OUT/table" > "$OUT/table.log" 2>&1
  grep -E "^\||FAILED|Error" "$OUT/table.log"
}

# one attn_v5 variant (RQ_V5_DEFS=$1; "" the default; $2 the launch bound's blocks an SM, default 2): phase trace
# summary and ncu kernel-alone at 4K / 32K / 128K, tagged lines appended to $OUT/ncu.txt (session 10's A/B calls)
v5_variant() {
  local defs=$1 minb=${2:-2} tag ncu
  tag=${defs:-base}; tag=${tag//,/_}; [ "$minb" = 2 ] || tag=${tag}_minb$minb
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  echo "== $tag ($(date -u +%T))"
  RQ_V5_DEFS=$defs RQ_V5_MINB=$minb timeout 30 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 3 \
    > "$OUT/trace_$tag.txt" 2>&1
  grep -v Warning "$OUT/trace_$tag.txt" | grep -E "^==|q rotated|q fragments|partials written|counted|weights|numerators|stored" \
    | sed -E 's/blocks on .*span/span/; s/\(runs.*//'
  RQ_V5_DEFS=$defs timeout 40 "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$OUT/ncu_$tag.csv" python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 3 \
    --methods "v5 256" --v5-configs 256:$minb:132:1:2:2 --schedule "$OUT/sched_$tag.json" > /dev/null 2>&1
  python3 benchmarks/kernel_time.py --parse "$OUT/ncu_$tag.csv" --schedule "$OUT/sched_$tag.json" 2>&1 \
    | grep "^| [0-9]" | sed "s/^/$tag /" | tee -a "$OUT/ncu.txt"
  rm -f "$OUT/ncu_$tag.csv" "$OUT/sched_$tag.json"
}
