#!/usr/bin/env bash
# Session 15, call 4 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): the whole decode step of a
# Qwen3-30B-A3B-shaped model (random weights quantized as qwen3-16gb, 4 layers timed and scaled to 48) with the
# compressed cache as `rq run` makes it (isoquant3: pair codebooks, 32-token fp16 window; one kv_append and one attn_v5
# launch a layer) against the fp16 cache, at 2K-128K. Last measured 2026-11-29, before kv_append and v4/v5.
set -u
OUT=${OUT:-$PWD/s15b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== profile ($(date -u +%T))"
timeout 540 python3 benchmarks/profile_gpu.py --layers 4 --contexts 2048,8192,32768,131072 --kv isoquant3,fp16 \
  --repeats 10 --warmup 3 --out "$OUT" > "$OUT/profile.log" 2>&1
echo "rc $?"
grep -vE "^\s*$" "$OUT/profile.log" | cut -c1-400 | tail -40
echo "== done ($(date -u +%T))"
