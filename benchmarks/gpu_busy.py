"""GPU busy time of a decode layer's attention, apart from the host's launch cost (CUDA; needs torch for CUPTI).

attention.py times a chained decode layer from the host; this runs the same 64-layer chains under torch.profiler:
CUPTI records every kernel in the process, MLX's included, and the CUDA runtime calls MLX makes. Per method it reports
the wall µs a layer, the GPU busy time a layer (kernels, by name), the idle gaps between kernels, and the runtime
calls' host time a layer.

    python3 benchmarks/gpu_busy.py --contexts 131072,32768 --layers 64 --reps 3 --methods fp16,fused,fused-pair
    (methods: fp16, qmm8, qmm4, turbo3, four, fused, fused-window, fused-pair: pair codebooks (128, 32))

Writes benchmarks/results/gpu_busy.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx.core as mx  # noqa: E402

import attention as A  # noqa: E402


def profile_chain(L, f, nl: int, reps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):  # compile, warm the graph cache
        mx.eval(A.chained(L, f, nl))
    mx.synchronize()
    walls, spans = [], []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            outs = A.chained(L, f, nl)
            torch.cuda._sleep(1000)  # a marker kernel ("spin_kernel") between repetitions
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t0_us = time.time_ns() / 1e3
            mx.eval(outs)
            mx.synchronize()
            walls.append((time.perf_counter() - t0) * 1e6 / nl)
            spans.append((t0_us, time.time_ns() / 1e3))
            del outs
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    ev = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    allk = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runtime = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    reps_k, lead = [], []
    for e in allk:  # each repetition: the kernels after a marker
        if "spin" in e["name"]:
            reps_k.append([])
            lead.append(e["ts"] + e["dur"])
        elif reps_k:
            reps_k[-1].append(e)
    lead = [r[0]["ts"] - t for r, t in zip(reps_k, lead) if r]
    kernels = [k for r in reps_k for k in r]
    by_name = collections.defaultdict(float)
    for e in kernels:
        by_name[e["name"][:60]] += e["dur"]
    busy = [sum(k["dur"] for k in r) / nl for r in reps_k if r]
    span = [(r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"]) / nl for r in reps_k if r]
    inner = [b["ts"] - (a["ts"] + a["dur"]) for r in reps_k for a, b in zip(r, r[1:])]
    rt = collections.defaultdict(lambda: [0, 0.0])
    for e in runtime:
        rt[e["name"]][0] += 1
        rt[e["name"]][1] += e.get("dur", 0)
    n_rep = max(1, len(reps_k))
    return {
        "wall_us_layer": statistics.median(walls),
        "gpu_span_us_layer": statistics.median(span) if span else None,
        "gpu_busy_us_layer": statistics.median(busy) if busy else None,
        "kernels_per_layer": len(kernels) / n_rep / nl,
        "gap_mean_us": statistics.mean(inner) if inner else None,
        "gap_median_us": statistics.median(inner) if inner else None,
        "gap_max_us": max(inner) if inner else None,
        "gaps_over_5us_per_rep": sum(g > 5 for g in inner) / max(1, len(reps_k)),
        "lead_us_before_first_kernel": statistics.median(lead) if lead else None,
        "kernel_us_layer_by_name": {k: v / n_rep / nl for k, v in sorted(by_name.items(), key=lambda x: -x[1])},
        "runtime_calls_per_rep": {k: dict(n=v[0] / n_rep, us=v[1] / n_rep) for k, v in
                                  sorted(rt.items(), key=lambda x: -x[1][1])[:12]},
        "reps_seen": len(reps_k),
    }


def table(runs: list[dict]) -> str:
    """GPU busy µs a layer by context and method, with the ratio to fp16's."""
    out = ["| context | method | GPU busy µs / layer | x fp16 | wall µs / layer | kernels / layer |",
           "| --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        fp16 = run["methods"].get("fp16", {}).get("gpu_busy_us_layer")
        for m, r in run["methods"].items():
            if r.get("gpu_busy_us_layer") is None:
                continue
            ratio = f"{fp16 / r['gpu_busy_us_layer']:.2f}x" if fp16 else "-"
            out.append(f"| {run['context'] // 1024}K | {m} | {r['gpu_busy_us_layer']:.1f} | {ratio} | "
                       f"{r['wall_us_layer']:.1f} | {r['kernels_per_layer']:.0f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="131072", help="comma-separated contexts, one after another")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--methods", default="fp16,fused,fused-pair")
    a = ap.parse_args()
    import numpy as np

    runs = []
    for T in [int(t) for t in a.contexts.split(",")]:
        L = A.build(T, a.layers, np.random.default_rng(0), qmm="qmm" in a.methods)
        table_ = {"fp16": lambda i: A.fp16_sdpa(L, i), "fused": lambda i: A.iso_fused(L, i),
                  "qmm8": lambda i: A.qmm(L, i, 8), "qmm4": lambda i: A.qmm(L, i, 4),
                  "turbo3": lambda i: A.turbo3(L, i), "four": lambda i: A.iso_four(L, i),
                  "fused-window": lambda i: A.iso_fused_window(L, i), "fused-pair": lambda i: A.iso_fused_pair(L, i)}
        if "fused-pair" in a.methods.split(","):
            A.pair_inputs(L)
        res = {}
        for m in a.methods.split(","):
            try:
                res[m] = profile_chain(L, table_[m], a.layers, a.reps)
            except Exception as e:  # report and go on
                res[m] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"== {m} (context {T}, {a.layers} chained layers)")
            print(json.dumps(res[m], indent=1)[:3000], flush=True)
        for m, r in res.items():
            if "error" not in r:
                print(f"summary {T} {m:14s} wall {r['wall_us_layer']:.1f} span {r['gpu_span_us_layer']:.1f} "
                      f"busy {r['gpu_busy_us_layer']:.1f} k/layer {r['kernels_per_layer']:.2f} gap mean "
                      f"{r['gap_mean_us']:.2f} max {r['gap_max_us']:.1f} lead {r['lead_us_before_first_kernel']:.0f}")
        runs.append(dict(context=T, layers=a.layers, methods=res))
        del L, table_
        mx.clear_cache()
    body = table(runs)
    print(body)
    from _readme import save

    save("gpu_busy", {"runs": runs}, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
