"""Decode attention a layer on the GPU, every method side by side in one process.

Shape: Qwen3-30B-A3B attention, batch 1, one new token: 32 query heads, 4 kv heads, head_dim 128.
Methods: fp16 mx.fast.scaled_dot_product_attention; mlx-lm-style quantized attention (two mx.quantized_matmul, 8-bit
and 4-bit, group 64); TurboQuant-3 (a dense rotation as matmuls around the packed-attention kernel); IsoQuant-3
through the four-kernel pipeline (query rotation, scores, softmax, values, inverse rotation: what `rq profile` times)
and through the fused single-launch kernel (scalar codebooks, the cache's 32-token fp16 window, and the pair
codebooks (128, 32) that isoquant3 uses by default). Also the four-kernel pipeline stage by stage.

Timing: each evaluation runs NL layers (each with its own K/V, so L2 never holds the context); with --chain layer
i+1's query is layer i's output, and with --pipeline N the chained decode steps are queued while the GPU runs the
previous one, host time included, as `rq run` decodes. Copy bandwidth is measured in the same run (MLX elementwise
copy, and torch's device-to-device copy when torch is importable).

    python3 benchmarks/attention.py --chain --pipeline 4 --layers 64 --reps 5 --skip-stages   # the README's table
    python3 benchmarks/attention.py [--contexts 4096,32768,131072] [--methods SUBSTR,=EXACT] [--fused-configs ...]

Writes benchmarks/results/attention.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import rq_core.kernels.launch as K  # noqa: E402
from rq_core.codec.rotation import quat_left, quat_right  # noqa: E402

HQ, HKV, D, BITS = 32, 4, 128, 3
G = HQ // HKV
SCALE = 1.0 / math.sqrt(D)


def timeit(fn, nl: int, reps: int, warm: int = 3) -> list[float]:
    """Per-layer microseconds of each repetition: fn() returns the list of arrays for NL layers."""
    for _ in range(warm):
        mx.eval(fn())
    mx.synchronize()
    out = []
    for _ in range(reps):
        outs = fn()  # build the graph first: time evaluation (encode + GPU), not Python graph building
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        out.append((time.perf_counter() - t0) * 1e6 / nl)
        del outs
    return out


def peak_extra(fn) -> int:
    """Extra bytes at peak while one layer runs (its inputs already live)."""
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn())
    mx.synchronize()
    return mx.get_peak_memory() - base


def copy_bandwidth(reps: int = 20) -> dict:
    res = {}
    n = 1 << 29  # 512 Mi fp16 = 1 GiB
    x = mx.random.normal((n,)).astype(mx.float16)
    mx.eval(x)
    ts = []
    for i in range(reps + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        y = x * 1.0  # elementwise: one read + one write
        mx.eval(y)
        mx.synchronize()
        if i >= 3:
            ts.append(time.perf_counter() - t0)
        del y
    res["mlx_elementwise_TBps"] = 2 * x.nbytes / statistics.median(ts) / 1e12
    del x
    try:
        import torch

        a = torch.randn(n, device="cuda", dtype=torch.float16)
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in ev:
            s.record()
            b.copy_(a)
            e.record()
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in ev)
        res["torch_copy_TBps"] = 2 * a.nbytes / (ms / 1e3) / 1e12
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:  # torch absent or unable to share the GPU: MLX's number stands alone
        res["torch_error"] = f"{type(e).__name__}: {e}"[:200]
    res["copy_TBps"] = max(v for k, v in res.items() if k.endswith("TBps"))
    return res


def dense_rotations(rng: np.random.Generator) -> np.ndarray:
    out = []
    for _ in range(HKV):
        qm, r = np.linalg.qr(rng.standard_normal((D, D)))
        out.append(qm * np.sign(np.diag(r)))
    return np.stack(out).astype(np.float32)  # [Hkv, D, D]


def build(T: int, nl: int, rng: np.random.Generator, qmm: bool = True) -> dict:
    """NL layers of inputs for every method at context T (qmm=False: skip the mx.quantize'd K/V)."""
    W = D * BITS // 32
    L = {"q": [], "k16": [], "v16": [], "kq8": [], "vq8": [], "kq4": [], "vq4": [], "kc": [], "kn": [], "vc": [],
         "vn": [], "mats": [], "dense": []}
    for _ in range(nl):
        q = mx.random.normal((1, HQ, 1, D)).astype(mx.float16)
        k = mx.random.normal((1, HKV, T, D)).astype(mx.float16)
        v = mx.random.normal((1, HKV, T, D)).astype(mx.float16)
        L["q"].append(q)
        L["k16"].append(k)
        L["v16"].append(v)
        for b in (8, 4) if qmm else ():
            L[f"kq{b}"].append(mx.quantize(k, group_size=64, bits=b))
            L[f"vq{b}"].append(mx.quantize(v, group_size=64, bits=b))
        L["kc"].append(mx.random.randint(-2**31, 2**31 - 1, (1, HKV, T, W)).astype(mx.uint32))
        L["vc"].append(mx.random.randint(-2**31, 2**31 - 1, (1, HKV, T, W)).astype(mx.uint32))
        L["kn"].append(mx.random.uniform(0.5, 2.0, (1, HKV, T)).astype(mx.float16))
        L["vn"].append(mx.random.uniform(0.5, 2.0, (1, HKV, T)).astype(mx.float16))
        g = rng.standard_normal((HKV, D // 4, 2, 4))
        g /= np.linalg.norm(g, axis=-1, keepdims=True)
        conj = g[..., 1, :] * np.array([1.0, -1.0, -1.0, -1.0])
        L["mats"].append(mx.array((quat_left(g[..., 0, :]) @ quat_right(conj)).astype(np.float32)))
        L["dense"].append(mx.array(dense_rotations(rng)))
        mx.eval([x for vals in L.values() for x in vals[-1:]])
    L["levels"] = mx.array(np.sort(np.random.default_rng(1).standard_normal(1 << BITS)).astype(np.float32))
    return L


def fp16_sdpa(L, i):
    return mx.fast.scaled_dot_product_attention(L["q"][i], L["k16"][i], L["v16"][i], scale=SCALE)


def qmm(L, i, bits):
    # as mlx-lm's quantized_scaled_dot_product_attention
    q = (L["q"][i] * SCALE).reshape(1, HKV, G, 1, D)
    kq, ks, kb = (mx.expand_dims(x, -3) for x in L[f"kq{bits}"][i])
    vq, vs, vb = (mx.expand_dims(x, -3) for x in L[f"vq{bits}"][i])
    s = mx.quantized_matmul(q, kq, ks, kb, transpose=True, group_size=64, bits=bits)
    p = mx.softmax(s, axis=-1, precise=True)
    return mx.quantized_matmul(p, vq, vs, vb, transpose=False, group_size=64, bits=bits).reshape(1, HQ, 1, D)


def turbo3(L, i):
    """TurboQuant-3: a dense per-head rotation as matmuls around the packed-attention kernel (no rotation in it)."""
    T = L["kc"][i].shape[2]
    Pi = L["dense"][i]  # [Hkv, D, D]
    q = L["q"][i].astype(mx.float32).reshape(1, HKV, G, D)
    qr = (q @ Pi.swapaxes(-1, -2)[None]).reshape(1, HQ, 1, D)
    o = K.fused_attention(qr, None, L["kc"][i], L["kn"][i], L["vc"][i], L["vn"][i], L["levels"], bits=BITS, scale=SCALE,
                       valid_len=T, rot=0, want_lse=False)[0]
    return (o.astype(mx.float32).reshape(1, HKV, G, D) @ Pi[None]).reshape(1, HQ, 1, D)


def iso_fused(L, i, nth=None, blocks=None, pf=None, vdec=None, stage=None):
    """The fused kernel (rotation, split-context attention, merge and inverse rotation in one launch); the launch
    configuration as given (threads per block, block target, load-ahead depth, value decode, copy-ring
    stages), else rq_core.kernels.launch' defaults."""
    T = L["kc"][i].shape[2]
    return K.fused_attention(L["q"][i], L["mats"][i], L["kc"][i], L["kn"][i], L["vc"][i], L["vn"][i], L["levels"],
                          bits=BITS, scale=SCALE, valid_len=T, nth=nth, blocks=blocks, pf=pf, vdec=vdec,
                          stage=stage, want_lse=False)[0]


def iso_fused_window(L, i, nw=32, key="win"):
    """The fused kernel with the cache's fp16 window (the newest nw tokens unquantized) as one more split of the
    same launch."""
    T = L["kc"][i].shape[2]
    if key not in L:  # one fp16 window per layer, built outside the timed region
        L[key] = [(mx.random.normal((1, HKV, nw, D)).astype(mx.float16),
                   mx.random.normal((1, HKV, nw, D)).astype(mx.float16)) for _ in range(len(L["kc"]))]
        mx.eval(L[key])
    return K.fused_attention(L["q"][i], L["mats"][i], L["kc"][i], L["kn"][i], L["vc"][i], L["vn"][i], L["levels"],
                          bits=BITS, scale=SCALE, valid_len=T, window=L[key][i], want_lse=False)[0]


def pair_inputs(L) -> None:
    """Pair codebooks (kv.pair_points (128, 32)): random 7-bit key fields (14 words a row) and 5-bit value fields
    (10 words), IsoQuant-3's bytes; random points. Built and evaluated once, before any timing."""
    if "kcp" in L:
        return
    T = L["kc"][0].shape[2]
    L["kcp"] = [mx.random.randint(-2**31, 2**31 - 1, (1, HKV, T, D * 7 // 64)).astype(mx.uint32) for _ in L["kc"]]
    L["vcp"] = [mx.random.randint(-2**31, 2**31 - 1, (1, HKV, T, D * 5 // 64)).astype(mx.uint32) for _ in L["kc"]]
    L["pk"], L["pv"] = mx.random.normal((128, 2)), mx.random.normal((32, 2))
    mx.eval(L["kcp"], L["vcp"], L["pk"], L["pv"])


def iso_fused_pair(L, i):
    """The fused kernel with pair codebooks (kv.pair_points (128, 32)); pair_inputs(L) first."""
    T = L["kcp"][i].shape[2]
    return K.fused_attention(L["q"][i], L["mats"][i], L["kcp"][i], L["kn"][i], L["vcp"][i], L["vn"][i], L["pv"], bits=5,
                          key_bits=7, key_levels=L["pk"], scale=SCALE, valid_len=T, want_lse=False)[0]


def iso_four(L, i, strategy="auto"):
    T = L["kc"][i].shape[2]
    return K.attention_four(L["q"][i], L["mats"][i], L["kc"][i], L["kn"][i], L["vc"][i], L["vn"][i], L["levels"],
                            bits=BITS, scale=SCALE, valid_len=T, strategy=strategy)


def iso_four_pair(L, i):
    """The four kernels with pair codebooks (kv.pair_points (128, 32)); pair_inputs(L) first."""
    T = L["kcp"][i].shape[2]
    return K.attention_four(L["q"][i], L["mats"][i], L["kcp"][i], L["kn"][i], L["vcp"][i], L["vn"][i], L["pv"], bits=5,
                            key_bits=7, key_levels=L["pk"], scale=SCALE, valid_len=T)


def chained(L, f, nl: int, prev: mx.array | None = None) -> list:
    """NL layers where each layer's query is the previous layer's output (fp16, [1, HQ, 1, D]): a data
    dependency between layers, so the GPU runs them one after another as in a decode step. prev: the
    output the first layer's query comes from (the previous decode step's), else its own query."""
    q0 = L["q"]
    qs = list(q0)
    L["q"] = qs
    try:
        out = prev
        for i in range(nl):
            if out is not None:
                qs[i] = out.astype(mx.float16).reshape(1, HQ, 1, D)
            out = f(i)
        return [out]
    finally:
        L["q"] = q0


def timeit_pipelined(L, f, nl: int, steps: int, reps: int, warm: int = 2) -> list[float]:
    """Per-layer µs of STEPS decode steps of NL chained layers, each step's graph built and queued
    (mx.async_eval) while the GPU runs the previous one, as rq's generate loop does: the steady state of
    a decode, where the host's graph building overlaps the GPU unless the host is the slower of the two.
    Timed from the first graph's building to the last step's end (host time included, unlike timeit)."""
    def run():
        out = None
        for _ in range(steps):
            out = chained(L, f, nl, out)[0]
            mx.async_eval(out)
        mx.eval(out)
        mx.synchronize()

    for _ in range(warm):
        run()
    res = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        res.append((time.perf_counter() - t0) * 1e6 / (steps * nl))
    return res


def bytes_read(method: str, T: int) -> int:
    rows = 2 * HKV * T  # K and V rows
    if method == "fp16 SDPA":
        return rows * D * 2
    if method.startswith("qmm"):
        b = int(method.split()[1].rstrip("-bit"))
        return rows * (D * b // 8 + 2 * 2 * (D // 64))
    return rows * (D * BITS // 8 + 2)  # packed codes + fp16 norm


METHODS = {  # name -> fn(L, i); the README's table runs all of them
    "fp16 SDPA": fp16_sdpa,
    "qmm 8-bit": lambda L, i: qmm(L, i, 8),
    "qmm 4-bit": lambda L, i: qmm(L, i, 4),
    "TurboQuant-3 (dense)": turbo3,
    "IsoQuant-3 four-kernel": iso_four,
    "IsoQuant-3 four-kernel pair codebooks": iso_four_pair,
    "IsoQuant-3 fused": iso_fused,
    "IsoQuant-3 fused + fp16 window 32": iso_fused_window,
    "IsoQuant-3 fused pair codebooks": iso_fused_pair,
}


def table(rows: list[dict]) -> str:
    """µs a layer, method by context, and the ratio to fp16 SDPA's time at the same context."""
    ctx = sorted({r["context"] for r in rows})
    by = {(r["method"], r["context"]): r for r in rows}
    names = list(dict.fromkeys(r["method"] for r in rows))
    out = ["| method | " + " | ".join(f"{t // 1024 if t >= 1024 else t}{'K' if t >= 1024 else ''} µs (x fp16)" for t in ctx) + " |",
           "| --- |" + " --- |" * len(ctx)]
    for n in names:
        cells = [f"{by[n, t]['us']:.1f} ({by[n, t]['ratio_vs_fp16']:.2f}x)" if (n, t) in by else "-" for t in ctx]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "qmm: mlx-lm's quantized attention (two `mx.quantized_matmul`, group 64). four-kernel: the pipeline "
            "`rq profile` times. fused: one launch a layer, as the compressed caches attend on a GPU (isoquant3's "
            "default: pair codebooks with the fp16 window)."]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--chain", action="store_true", help="layer i+1's query is layer i's output (as in a model's "
                    "decode step: the layers run one after another, never side by side on the GPU)")
    ap.add_argument("--pipeline", type=int, default=0, help="with --chain: time this many decode steps of the "
                    "chained layers, each queued while the previous runs (rq generate's loop), host time included")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--skip-stages", action="store_true", help="no stage-by-stage times of the four kernels")
    ap.add_argument("--methods", default="", help="comma-separated substrings (or =exact names): time only "
                    "matching methods (fp16 SDPA always runs: it is the baseline)")
    ap.add_argument("--fused-configs", default="", help="comma-separated THREADS:BLOCKS[:PF[:VDEC[:STAGE]]]: "
                    "extra rows of the fused kernel (threads per block, block target, load-ahead depth, "
                    "value decode, copy-ring stages; default: rq_core.kernels.launch' settings)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    info = {"device": str(mx.default_device()), "backend": K.backend(), "layers": a.layers, "chain": a.chain,
            "pipeline_steps": a.pipeline if a.chain else 0,
            "mlx_env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}}
    print("attention benchmark:", info, flush=True)
    bw = copy_bandwidth()
    print("copy bandwidth:", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in bw.items()}, flush=True)
    copy = bw["copy_TBps"]
    rows, stage_rows = [], []
    nl = a.layers
    keep = [m.strip() for m in a.methods.split(",")] if a.methods else []

    def wanted(name: str) -> bool:
        return not keep or name == "fp16 SDPA" or any(m[1:] == name if m.startswith("=") else m in name for m in keep)

    for T in [int(x) for x in a.contexts.split(",")]:
        L = build(T, nl, rng, qmm=wanted("qmm 8-bit") or wanted("qmm 4-bit"))
        methods = {name: (lambda i, f=f: f(L, i)) for name, f in METHODS.items()}
        for cfg in [tuple(int(v) for v in x.split(":")) for x in a.fused_configs.split(",") if x]:
            methods["IsoQuant-3 fused " + "/".join(map(str, cfg))] = lambda i, cfg=cfg: iso_fused(L, i, *cfg)
        methods = {k: f for k, f in methods.items() if wanted(k)}
        if any("pair codebooks" in k for k in methods):
            pair_inputs(L)
        res = {}
        for rnd in range(2):  # two rounds, interleaved: the spread between them is the noise
            for name, f in list(methods.items()):
                try:
                    if a.chain and a.pipeline:
                        ts = timeit_pipelined(L, f, nl, a.pipeline, a.reps)
                    else:
                        ts = timeit((lambda: chained(L, f, nl)) if a.chain else (lambda: [f(i) for i in range(nl)]),
                                    nl, a.reps)
                except Exception as e:  # a kernel that fails to build or launch: report it, time the rest
                    print(f"T={T:6d} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    del methods[name]
                    continue
                res.setdefault(name, []).append(statistics.median(ts))
        base = min(res["fp16 SDPA"])
        for name, f in methods.items():
            us = min(res[name])
            nb = bytes_read(name, T)
            extra = peak_extra(lambda: f(0))
            r = dict(context=T, method=name, us=us, us_rounds=res[name], ratio_vs_fp16=base / us,
                     bytes=nb, TBps=nb / us / 1e6, frac_copy=nb / us / 1e6 / copy, extra_peak_bytes=extra)
            rows.append(r)
            print(f"T={T:6d} {name:24s} {us:8.1f} us (rounds {', '.join(f'{x:.1f}' for x in res[name])})  "
                  f"x{base / us:5.2f} vs fp16  {nb / us / 1e6:5.2f} TB/s  {100 * nb / us / 1e6 / copy:5.1f}% copy  "
                  f"extra {extra / 2**20:7.2f} MiB", flush=True)
        # four-kernel pipeline stage by stage (what `rq profile` times)
        if a.skip_stages:
            del L
            mx.clear_cache()
            continue
        qr = [K.rotate_queries(L["q"][j], L["mats"][j], HKV) for j in range(nl)]
        sc = [K.qk_dot(qr[j], L["kc"][j], L["kn"][j], L["levels"], bits=BITS, scale=SCALE, valid_len=T)
              for j in range(nl)]
        pr = [K.softmax(x) for x in sc]
        ov = [K.value_accum(pr[j], L["vc"][j], L["vn"][j], L["levels"], bits=BITS) for j in range(nl)]
        mx.eval(qr, sc, pr, ov)
        stages = {
            "rotate query": lambda: [K.rotate_queries(L["q"][j], L["mats"][j], HKV) for j in range(nl)],
            "A qk_dot": lambda: [K.qk_dot(qr[j], L["kc"][j], L["kn"][j], L["levels"], bits=BITS, scale=SCALE,
                                          valid_len=T) for j in range(nl)],
            "B softmax": lambda: [K.softmax(sc[j]) for j in range(nl)],
            "C value_accum": lambda: [K.value_accum(pr[j], L["vc"][j], L["vn"][j], L["levels"], bits=BITS)
                                      for j in range(nl)],
            "D rotate_inverse": lambda: [K.rotate_inverse(ov[j], L["mats"][j], HKV) for j in range(nl)],
        }
        for name, f in stages.items():
            us = statistics.median(timeit(f, nl, max(5, a.reps // 3)))
            stage_rows.append(dict(context=T, stage=name, us=us))
            print(f"T={T:6d}   stage {name:18s} {us:8.1f} us", flush=True)
        del L, qr, sc, pr, ov
        mx.clear_cache()
    body = table(rows)
    print("\n" + body)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _readme import save

    save("attention", dict(info=info, copy=bw, rows=rows, stages=stage_rows), body)


if __name__ == "__main__":
    main()
