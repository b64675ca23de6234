"""Check rq_core.kernels.cache on a CUDA machine: two processes, the second loads what the first wrote.

    python3 tools/kernel_cache_check.py --phase write --out DIR   # process 1
    python3 tools/kernel_cache_check.py --phase read --out DIR    # process 2

write: the fused kernel + window 32 at 4,096 tokens (the default decode path) compiled by MLX as usual (its first launch
timed), outputs saved; then the same launch through kernel_cache, which compiles the generated source with
NVRTC and writes it into MLX's PTX cache. read: a new process, the same inputs: the first launch must be
fast (MLX found the module) and its outputs equal to MLX's own compile's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import attention as A  # noqa: E402
from rq_core.kernels import cache as kernel_cache  # noqa: E402


def run_once(L) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    out = A.iso_v5_window(L, 0)
    mx.eval(out)
    mx.synchronize()
    return np.array(out.astype(mx.float32)), time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["write", "read"], required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    L = A.build(4096, 1, np.random.default_rng(0), qmm=False)
    res: dict = {"phase": a.phase, "cache_dir": str(kernel_cache.cache_dir())}
    if a.phase == "write":
        os.environ["RQ_KERNEL_CACHE"] = "0"
        ref, t_first = run_once(L)
        _, t_second = run_once(L)
        np.save(out / "ref.npy", ref)
        os.environ["RQ_KERNEL_CACHE"] = "1"
        t0 = time.perf_counter()
        run_once(L)  # through kernel_cache: NVRTC compile + cache write (MLX keeps its loaded module)
        res.update(first_launch_s=t_first, second_launch_s=t_second, cache_write_s=time.perf_counter() - t0,
                   warned=bool(kernel_cache._WARNED))
        d = Path(res["cache_dir"])
        res["cache_entries"] = sorted(p.name for p in d.glob("custom_kernel_rq_*"))[:20] if d.is_dir() else []
        res["mlx_entries"] = len(list(d.glob("*.ptx"))) if d.is_dir() else 0
    else:
        ref = np.load(out / "ref.npy")
        got, t_first = run_once(L)
        _, t_second = run_once(L)
        res.update(first_launch_s=t_first, second_launch_s=t_second,
                   max_abs_diff=float(np.abs(got - ref).max()), equal=bool(np.array_equal(got, ref)),
                   nan=int(np.isnan(got).sum()))
    print(json.dumps(res, indent=1))
    (out / f"{a.phase}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
