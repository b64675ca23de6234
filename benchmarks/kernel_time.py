"""GPU time of the attention kernels alone, read by Nsight Compute (ncu), apart from MLX's per-op cost.

MLX's dispatch costs ~25-35 µs per op here and overlaps GPU work, so wall time per layer hides a kernel
that is faster than that. This driver runs each (context, method) as its own phase: one layer of inputs
(the Qwen3-30B-A3B shape of benchmarks/attention.py) evaluated --reps times, each phase opened by a
marker kernel `rq_marker` whose name carries the phase number. Under ncu, the kernels between two markers
are that phase's (each phase also ends with a marker numbered END + phase, so the next method's warm-up and
compile launches stay out): their summed GPU time / reps is the method's GPU time per layer.

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \\
        --log-file OUT/ncu.csv python3 benchmarks/kernel_time.py --schedule OUT/schedule.json [--v5-configs ...]
    python3 benchmarks/kernel_time.py --parse OUT/ncu.csv --schedule OUT/schedule.json [--copy-tbps 4.2]

(ncu serialises kernels and flushes the caches before each, so this is each kernel alone from DRAM.)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


END = 100000  # end-of-phase markers: END + phase


def _marker(mx):
    return mx.fast.cuda_kernel(name="rq_marker", input_names=["x"], output_names=["y"],
                               source="if (threadIdx.x == 0) y[0] = x[0] + (float)PHASE;\n")


def methods(K, A, L, v5cfgs):
    """name -> fn(i) of one layer, as benchmarks/attention.py builds them."""
    m = {"fp16 SDPA": lambda i: A.fp16_sdpa(L, i), "v4": lambda i: A.iso_v4(L, i),
         "v4 + window 32": lambda i: A.iso_v4_window(L, i), "v5": lambda i: A.iso_v5(L, i),
         "v5 + window 32": lambda i: A.iso_v4_window(L, i, version="v5"), "v5 sacc1": lambda i: A.iso_v5_sacc(L, i, 1),
         # isoquant3's default codebooks (pairs, 128 / 32 points); the pair inputs are built on first use
         "v5 pair": lambda i: (A.pair_inputs(L), A.iso_v5_pair(L, i))[1]}
    for nw in [int(x) for x in os.environ.get("KT_WINDOWS", "").split(",") if x]:  # window-size probes
        for v in ("v4", "v5"):
            m[f"{v} + window {nw}"] = lambda i, nw=nw, v=v: A.iso_v4_window(L, i, nw=nw, version=v, key=f"win{nw}")
    for cfg in v5cfgs:
        m["v5 " + "/".join(map(str, cfg))] = lambda i, c=cfg: A.iso_v5(L, i, *c)
    return m


def run(a) -> None:
    import mlx.core as mx
    import numpy as np

    import attention as A
    import rq_core.kernels as K

    v5cfgs = [tuple(int(v) for v in c.split(":")) for c in a.v5_configs.split(",") if c]
    marker = _marker(mx)
    x = mx.zeros((1,), mx.float32)
    mx.eval(x)
    schedule, phase = [], 0
    rng = np.random.default_rng(0)
    keep = [s for s in a.methods.split(",") if s]
    for T in [int(t) for t in a.contexts.split(",")]:
        L = A.build(T, 1, rng, qmm=False)
        for name, f in methods(K, A, L, v5cfgs).items():
            if keep and not any(k in name for k in keep):
                continue
            try:
                mx.eval(f(0))  # compile (JIT) and warm up outside the phase
                mx.synchronize()
            except Exception as e:
                print(f"T={T} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            phase += 1
            mx.eval(marker(inputs=[x], template=[("PHASE", phase)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                           output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
            mx.synchronize()
            for _ in range(a.reps):
                mx.eval(f(0))
                mx.synchronize()
            mx.eval(marker(inputs=[x], template=[("PHASE", END + phase)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                           output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
            mx.synchronize()
            schedule.append(dict(phase=phase, context=T, method=name, reps=a.reps, bytes=A.bytes_read(
                "fp16 SDPA" if name == "fp16 SDPA" else "iso", T)))
        del L
        mx.clear_cache()
    if a.schedule:
        Path(a.schedule).write_text(json.dumps(schedule, indent=1))
    print(f"kernel_time: {len(schedule)} phases", flush=True)


def parse(a) -> None:
    schedule = json.loads(Path(a.schedule).read_text())
    lines = [ln for ln in Path(a.parse).read_text().splitlines() if ln.startswith('"')]  # not ==PROF== lines
    rows = list(csv.DictReader(lines))
    kern: dict = {}  # (id, name) -> {metric: value}
    order = []
    for r in rows:
        key = (r["ID"], r["Kernel Name"])
        if key not in kern:
            kern[key] = {}
            order.append(key)
        try:
            kern[key][r["Metric Name"]] = (float(r["Metric Value"].replace(",", "")), r["Metric Unit"])
        except ValueError:
            pass
    phases: dict = {}
    cur = None
    for key in order:
        if "rq_marker_" in key[1]:
            num = int(key[1].split("rq_marker_")[1].split("(")[0].split("_")[0])
            cur = num if num < END else None  # an end marker closes its phase
            continue
        if cur is not None:
            phases.setdefault(cur, []).append(key)
    out = []
    for s in schedule:
        ks = phases.get(s["phase"], [])
        ns = 0.0
        dram = 0.0
        per = []
        for k in ks:
            v, unit = kern[k].get("gpu__time_duration.sum", (0.0, "ns"))
            per.append(v * {"ns": 1.0, "nsecond": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}.get(unit, 1.0))
            ns += per[-1]
            b, bu = kern[k].get("dram__bytes_read.sum", (0.0, "byte"))
            dram += b * {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6}.get(bu, 1)
        us = ns / 1e3 / s["reps"]
        # the fastest repetition too: a phase's first launch at a new context has measured 3.4x the others
        # (2026-11-30, 128K: 236 against 68.6 / 68.8 µs), which the mean carries
        kpr = len(ks) // s["reps"] if s["reps"] and len(ks) % s["reps"] == 0 else 0
        best = min(sum(per[i:i + kpr]) for i in range(0, len(per), kpr)) / 1e3 if kpr else us
        row = dict(s, kernels_per_rep=len(ks) / s["reps"], gpu_us=us, gpu_us_best_rep=best,
                   dram_read_MB=dram / 1e6 / s["reps"], TBps=s["bytes"] / us / 1e6 if us else 0.0)
        out.append(row)
    copy = a.copy_tbps
    print("| context | method | GPU µs / layer (ncu) | best repetition | kernels | bytes that must be read | TB/s | % copy "
          "| DRAM read (ncu) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in out:
        print(f"| {r['context'] // 1024}K | {r['method']} | {r['gpu_us']:.1f} | {r['gpu_us_best_rep']:.1f} | "
              f"{r['kernels_per_rep']:.0f} | "
              f"{r['bytes'] / 1e6:.1f} MB | {r['TBps']:.2f} | {100 * r['TBps'] / copy:.0f}% | "
              f"{r['dram_read_MB']:.1f} MB |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", default="", help="comma-separated substrings of method names to run")
    ap.add_argument("--v5-configs", default="", help="NTH:MINB:BLOCKS[:PF[:VDEC[:STAGE]]],... attn_v5 configurations")
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--parse", default=None, help="ncu --csv log to read (with --schedule)")
    ap.add_argument("--copy-tbps", type=float, default=4.24)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.parse:
        parse(a)
    else:
        run(a)


if __name__ == "__main__":
    main()
