#!/usr/bin/env bash
# Ran 2026-11-30 as session 10's call 1 (benchmarks/results/s10_2026-11-30/call1): the one-pass merge was no faster
# (splits merged 4.3-5.0 us against 4.4) and stays out of the kernel; so did SACC 4 (50.1 against 50.4 us at 128K).
# Session 9, last call (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; ~100 s of device time
# left): the last block's splits merged in one online pass with selects, no branch (round 3's branch serialized the
# loads: 9-10 us). Phase trace, kernels_check's quick v5 set, ncu kernel-alone (then with RQ_V5_SACC=4); each
# writes $OUT as it goes. First apply the kernel change (applies cleanly on 2026-11-30's HEAD, kernel tests pass):
#   git show 34dbe10 -- metal/attn_v5.body rq_core/kernels.py tests/test_kernels.py | git apply --3way
set -u
OUT=${OUT:-$PWD/s9f_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
echo "== trace ($(date -u +%T))"
timeout 30 python3 benchmarks/diag/v5_trace.py --contexts 4096,32768,131072 --reps 3 > "$OUT/trace.txt" 2>&1
grep -v Warning "$OUT/trace.txt" | grep -E "==|merged|counted|stored|loop end"
echo "== correctness ($(date -u +%T))"
timeout 50 python3 benchmarks/kernels_check.py --only v5 --quick-v5 > "$OUT/check.log" 2>&1
grep -E "FAIL|passed" "$OUT/check.log" | tail -3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
echo "== ncu ($(date -u +%T))"
timeout 40 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu.csv" \
  python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 2 --methods "v5 256" \
  --v5-configs 256:2:132:1:2:2 --schedule "$OUT/schedule.json" > /dev/null 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu.csv" --schedule "$OUT/schedule.json" 2>&1 | tail -4
echo "== ncu, four score accumulators (RQ_V5_SACC=4: chains of 4 matrix ops; CPU executor only so far) ($(date -u +%T))"
RQ_V5_SACC=4 timeout 40 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$OUT/ncu_s4.csv" \
  python3 benchmarks/kernel_time.py --contexts 4096,32768,131072 --reps 2 --methods "v5 256" \
  --v5-configs 256:2:132:1:2:2 --schedule "$OUT/schedule_s4.json" > /dev/null 2>&1
python3 benchmarks/kernel_time.py --parse "$OUT/ncu_s4.csv" --schedule "$OUT/schedule_s4.json" 2>&1 | tail -4
echo "== done ($(date -u +%T))"
