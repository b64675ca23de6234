#!/usr/bin/env bash
# Session 15, call 17 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): a long prompt's prefill with
# kv.prefill_fp16 (older prompt tokens compressed as the chunks arrive, attended by the reference path) against the
# whole prompt in fp16 (before) and the fp16 cache: time and peak memory, 4 layers of the Qwen3-30B-A3B shape.
set -u
OUT=${OUT:-$PWD/s15g_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== prefill_memory ($(date -u +%T))"
timeout ${PM_TIMEOUT:-400} python3 benchmarks/prefill_memory.py --layers 4 --contexts ${PM_CONTEXTS:-8192,32768} ${PM_ARGS:-} > "$OUT/prefill_memory.log" 2>&1
echo "rc $?"; cat "$OUT/prefill_memory.log" | tail -8
echo "== done ($(date -u +%T))"
