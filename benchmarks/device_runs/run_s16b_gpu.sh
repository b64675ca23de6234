#!/usr/bin/env bash
# Session 16, call 8 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin): kv_decode (packed rows back
# to vectors in one launch) checked against float64, then a prompt chunk's decoded attention alone (peak), the prefill
# chunk by chunk (peaks), and run_s16a's prefill table, all with kv_decode and the per-layer ordering edge.
set -u
OUT=${OUT:-$PWD/s16b_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== decode_check ($(date -u +%T))"
timeout 120 python3 benchmarks/diag/decode_check.py > "$OUT/decode_check.log" 2>&1; echo "rc $?"; tail -4 "$OUT/decode_check.log"
echo "== sdpa_peak ($(date -u +%T))"
timeout 120 python3 benchmarks/diag/sdpa_peak.py --cache 2>&1 | tail -4
echo "== prefill_peaks ($(date -u +%T))"
timeout 200 python3 benchmarks/diag/prefill_peaks.py --context 32768 --every 16 > "$OUT/prefill_peaks.log" 2>&1
echo "rc $?"; grep "==" "$OUT/prefill_peaks.log"
OUT=$OUT PM_TIMEOUT=150 PM_TIMEOUT2=150 PM_CONTEXTS=8192,32768 bash benchmarks/device_runs/run_s16a_gpu.sh 2>&1 | grep -v "^gpu-env"
