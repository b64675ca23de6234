#!/usr/bin/env bash
# Session 8, device call 8 (after `bash .device/bin/gpu-stage-a`; carry .device/b, .device/bin; timeout 590):
# why did call 6's first `rq run --kv isoquant3` on a fresh machine pass its 150 s limit with the kernel cache
# on? Wall time of each process, the cache entries it left, its stderr.
set -u
OUT=${OUT:-$PWD/s8e_out}; mkdir -p "$OUT"
source .device/bin/gpu-env || exit 3
export MLX_PTX_CACHE_DIR=/tmp/mlx_fresh_$(date +%s)  # a fresh cache, as a fresh machine has
R='import sys; from rq_cli.main import app; sys.argv[0] = "rq"; app()'
P=$(python3 -c "print(open('rq_core/assets/heldout.txt').read()[:1000])")
C=$(python3 -c "from rq_core import kernel_cache as k; print(k.cache_dir())")
n() { ls "$C" 2>/dev/null | grep -c "custom_kernel_rq.*\.ptx"; }
one() {  # tag, env...
  local tag=$1; shift
  local t0=$(date +%s.%N)
  timeout 240 env "$@" python3 -c "$R" run --prompt "$P" -n 64 --json --kv isoquant3 > "$OUT/$tag.json" 2> "$OUT/$tag.err"
  local rc=$?
  local t1=$(date +%s.%N)
  echo "$tag rc=$rc wall $(python3 -c "print(round($t1-$t0,1))") s, rq kernels cached: $(n), all ptx: $(ls "$C" 2>/dev/null | grep -c '\.ptx')"
  python3 -c "import json; d=json.load(open('$OUT/$tag.json')); print('   ', {k: d.get(k) for k in ('first_step_s','steady_decode_tok_per_s','prefill_tok_per_s','decode_tok_per_s')})" 2>&1 | tail -1
  tail -3 "$OUT/$tag.err"
}
echo "== fresh machine ($(date -u +%T)), cache dir $C, rq kernels cached: $(n)"
one off1 RQ_KERNEL_CACHE=0
one on1 RQ_KERNEL_CACHE=1
one on2 RQ_KERNEL_CACHE=1
one off2 RQ_KERNEL_CACHE=0
ls "$C" | grep "custom_kernel_rq.*\.ptx" | sed 's/_[0-9a-f]*\.ptx$//' | sort | uniq -c > "$OUT/classes.txt"; cat "$OUT/classes.txt"
echo "== done ($(date -u +%T))"
