#!/usr/bin/env bash
# Session 18, call 2 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): kv.edge_layers' caches (4-bit
# scalar keys and values at head dim 128) through the GPU kernels: the cache against float64 (kv_append, attn_v5 with
# the fp16 window; a long prompt compressed while prefilled), then attn_v5's 4-bit cases against float64, outputs
# poisoned (kernels_check --only v5 --bits 4).
set -u
OUT=${OUT:-$PWD/s18a_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
for spec in "5000 0" "20000 1024"; do
  set -- $spec
  pc=""; [ "$2" != 0 ] && pc="--prefill-chunk $2 --prefill-fp16 4096"
  echo "== v4_cache_check 4-bit context $1 chunk $2 ($(date -u +%T))"
  RQ_CHECK_VERSIONS=v5 timeout 200 python3 benchmarks/v4_cache_check.py --bits 4 --context $1 --window 32 $pc --steps 3 \
    > "$OUT/v4_cache_check_b4_$1.log" 2>&1; echo "rc $?"; grep -c FAIL "$OUT/v4_cache_check_b4_$1.log"
  grep "norms\|all passed\|failed\|FAIL\|last prompt\|step 2" "$OUT/v4_cache_check_b4_$1.log" | head -8
done
echo "== kernels_check v5 4-bit ($(date -u +%T))"
timeout 240 python3 benchmarks/kernels_check.py --only v5 --bits 4 --out "$OUT/kc" > "$OUT/kernels_check.log" 2>&1
echo "rc $?"; tail -12 "$OUT/kernels_check.log"
echo "== done ($(date -u +%T))"
