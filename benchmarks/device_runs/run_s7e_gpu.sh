#!/usr/bin/env bash
# Session 7, device call 6 (fresh machine: stage-a first; carry .device/b, .device/bin; timeout 590): why the
# bundled model decodes at 50 tok/s with isoquant3 and 254 with fp16 on the H200 (call 5). rq run with a short
# prompt (~380 tokens), 128 new tokens, decode tok/s under variants; then rq profile (both modes, 2K).
set -u
OUT=${OUT:-$PWD/s7e_out}; mkdir -p "$OUT/logs"
source .device/bin/gpu-env || exit 3
P=$(python3 -c "print(open('rq_core/assets/heldout.txt').read()[:1000])")
echo "== warm-up: JIT compiles ($(date -u +%T))"
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
for kv in fp16 isoquant3; do timeout 150 python3 -c "$R" run --prompt "$P" -n 4 --json --kv $kv > /dev/null 2>&1; echo "warm $kv rc=$?"; done
echo "== decode tok/s ($(date -u +%T))"
run() {  # label, env..., -- rq args
  local label=$1; shift
  timeout 60 env "$@" > "$OUT/logs/$label.json" 2> "$OUT/logs/$label.err"
  python3 - "$OUT/logs/$label.json" "$label" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    print(f"{sys.argv[2]:28s} prompt {d['prompt_tokens']} decode {d['decode_tok_per_s']:7.1f} tok/s  prefill {d['prefill_tok_per_s']:8.1f} tok/s")
except Exception as e:
    print(sys.argv[2], "FAILED", type(e).__name__)
PY
}
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
for rep in 1 2; do
  run fp16_$rep python3 -c "$R" run --prompt "$P" -n 128 --json --kv fp16
  run iso_$rep python3 -c "$R" run --prompt "$P" -n 128 --json --kv isoquant3
  run iso_w0_$rep python3 -c "$R" run --prompt "$P" -n 128 --json --kv isoquant3 --kv-window 0
  run iso_v4_$rep RQ_ATTN=v4 python3 -c "$R" run --prompt "$P" -n 128 --json --kv isoquant3
  run iso_ops_$rep RQ_APPEND=ops python3 -c "$R" run --prompt "$P" -n 128 --json --kv isoquant3
  run iso_nographs_$rep MLX_USE_CUDA_GRAPHS=0 python3 -c "$R" run --prompt "$P" -n 128 --json --kv isoquant3
  run fp16_nographs_$rep MLX_USE_CUDA_GRAPHS=0 python3 -c "$R" run --prompt "$P" -n 128 --json --kv fp16
done
echo "== rq profile, 2K ($(date -u +%T))"
for kv in isoquant3 fp16; do
  timeout 90 python3 -c "$R" profile --context 2048 --kv $kv --json > "$OUT/logs/profile_$kv.json" 2> "$OUT/logs/profile_$kv.err"
  python3 -c "import json; d=json.load(open('$OUT/logs/profile_$kv.json')); print(json.dumps(d)[:1500])" 2>&1 | tail -2
done
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "== done ($(date -u +%T))"
