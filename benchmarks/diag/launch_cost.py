"""What a chained decode layer costs outside the attention kernel (docs/KERNEL_NOTES.md, "Session 6").

One process on the GPU, Qwen3-30B-A3B attention shape, 64 chained layers a evaluation (as attention.py
--chain): fp16 SDPA and v5 at one context, then custom kernels that only copy the query to the output (one
block) with attn_v5's 8 inputs (their shape/strides parameters, the k_norms slice view) and 4 outputs, with
either side cut to the query / the output alone, and with no slice view: which part of the launch costs.
SM clocks are sampled with nvidia-smi while each method runs. Session 6 (2026-11-30, 32K): fp16 42.0, v5 64.4,
null with attn_v5's arguments 18.7, null with the query only 9.7 µs a layer; clocks at 1980 MHz throughout.

    python3 benchmarks/diag/launch_cost.py [--context 131072] [--layers 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import mlx.core as mx  # noqa: E402

import attention as A  # noqa: E402

COPY = "for (unsigned int e = threadIdx.x; e < 4096u; e += blockDim.x) out[e] = q[e];\n"
# the same parameters attn_v5 makes MLX pass (shape / strides are passed where the source names them)
WIDE = ("if (q_strides[0] == -7 && k_codes_strides[0] == -7 && v_codes_strides[0] == -7 && k_norms_shape[2] == -7"
        " && k_norms_strides[0] == -7 && v_norms_strides[0] == -7 && mats[0] == -7.0f && consts[0] == -7.0f"
        " && counter[0] == 7u) return;\n") + COPY


INPUTS = ["q", "mats", "consts", "k_codes", "k_norms", "v_codes", "v_norms", "counter"]
OUTPUTS = ["out", "lse", "o_part", "ml_part"]


def null_kernels():
    """(8 inputs, 4 outputs), (1 input, 1 output), (8 inputs, 1 output), (1 input, 4 outputs)."""
    def make(name, ins, outs, src):
        return mx.fast.cuda_kernel(name=name, input_names=ins, output_names=outs, source=src,
                                   ensure_row_contiguous=False)
    return (make("rq_null_wide", INPUTS, OUTPUTS, WIDE), make("rq_null_narrow", ["q"], ["out"], COPY),
            make("rq_null_in8", INPUTS, ["out"], WIDE), make("rq_null_out4", ["q"], OUTPUTS, COPY))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import numpy as np

    import rq_core.kernels as K

    nl, T = a.layers, a.context
    L = A.build(T, nl, np.random.default_rng(0), qmm=False)
    wide, narrow, in8, out4 = null_kernels()
    ns = K.v5_plan(T, A.HKV)
    o_shapes = [(1, A.HQ, 1, A.D), (1, A.HQ, 1), (A.HKV, ns, 8, A.D), (A.HKV, ns, 8, 2)]
    o_types = [mx.float16, mx.float32, mx.float32, mx.float32]

    def ins8(i, sliced=True):
        return [L["q"][i], L["mats"][i], K._consts(L["levels"], A.SCALE), L["kc"][i],
                L["kn"][i][:, :, :T] if sliced else L["kn"][i], L["vc"][i], L["vn"][i], K._counter(A.HKV)]

    def launch(k, inputs, n_out):
        return k(inputs=inputs, grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=o_shapes[:n_out],
                 output_dtypes=o_types[:n_out])[0]

    methods = {"fp16 SDPA": lambda i: A.fp16_sdpa(L, i), "v5": lambda i: A.iso_v5(L, i),
               "v5 + window 32": lambda i: A.iso_v4_window(L, i, version="v5"),
               "null kernel, attn_v5's arguments": lambda i: launch(wide, ins8(i), 4),
               "null kernel, attn_v5's arguments, no slice view": lambda i: launch(wide, ins8(i, False), 4),
               "null kernel, 8 inputs, 1 output": lambda i: launch(in8, ins8(i), 1),
               "null kernel, 1 input, 4 outputs": lambda i: launch(out4, [L["q"][i]], 4),
               "null kernel, query only": lambda i: launch(narrow, [L["q"][i]], 1)}
    res = {}
    for rnd in range(2):
        for name, f in methods.items():
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw", "--format=csv,noheader,nounits",
                                    "-lms", "20"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            time.sleep(0.2)
            ts = A.timeit(lambda: A.chained(L, f, nl), nl, a.reps)
            smi.terminate()
            out = smi.communicate()[0].strip().splitlines()
            clk = [float(x.split(",")[0]) for x in out if x.strip() and x.split(",")[0].strip().replace(".", "").isdigit()]
            r = res.setdefault(name, {"us": [], "sm_mhz": []})
            r["us"].append(statistics.median(ts))
            r["sm_mhz"] += clk
    print(f"launch_cost: context {T}, {nl} chained layers, MLX {mx.__version__}")
    print("| method | µs / layer (best of 2 medians) | SM clock MHz (median, min-max sampled) |")
    print("| --- | --- | --- |")
    for name, r in res.items():
        c = r["sm_mhz"]
        cs = f"{statistics.median(c):.0f} ({min(c):.0f}-{max(c):.0f}, n={len(c)})" if c else "-"
        print(f"| {name} | {min(r['us']):.1f} | {cs} |")
    if a.out:
        Path(a.out).write_text(json.dumps({k: dict(us=v["us"], sm_mhz=v["sm_mhz"][:400]) for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
