"""Output error of 3-bit compressed attention vs fp16 attention, per rotation variant.

Keys get a few outlier channels (10-50× larger than the rest, as real keys have); values and
queries are Gaussian. For each variant we quantize K and V exactly as the IsoQuant cache does
(norm → rotation → Lloyd-Max sphere codebook → packing), run the reference compressed-space
attention, and compare with fp32 attention on the original K/V. Errors are relative L2 norms,
averaged over layers × kv heads (each (layer, head) has its own rotation parameters).

    python3 tools/rotation_error.py [--dim 128] [--tokens 512] [--layers 16] [--queries 16]

Synthetic keys on the CPU: the table ranks rotations, it does not predict perplexity (benchmarks/quality.py does).
Writes tools/rotation_error.json.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from pathlib import Path
import time

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
sys.path.insert(0, str(ROOT / "benchmarks"))  # _readme: the results file's format

from rq_core.attention.reference import packed_attention, reference_attention
from rq_core.codec.codebook import sphere_codebook
from rq_core.cache.kv_cache import dequantize_kv, quantize_kv
from rq_core.codec.rotation import VARIANTS, Rotation


def make_keys(rng, H, T, d, n_outliers, lo, hi, biased):
    k = rng.standard_normal((1, H, T, d))
    for h in range(H):
        ch = rng.choice(d, n_outliers, replace=False)
        scale = rng.uniform(lo, hi, n_outliers)
        if biased:  # outlier channels with a consistent sign per channel (a large mean), as in RoPE'd keys
            k[0, h, :, ch] = (scale[:, None] * (np.sign(rng.standard_normal(n_outliers))[:, None]
                                                + 0.3 * k[0, h, :, ch]))
        else:
            k[0, h, :, ch] *= scale[:, None]
    return k.astype(np.float32)


def measure(variant, keys, values, queries, layer, bits, norm_correction, codebook):
    _, H, T, d = keys.shape
    rot = Rotation(d, H, variant=variant, seed=0, layer=layer)
    levels = mx.array(codebook.levels.astype(np.float32))
    K, V, Q = mx.array(keys), mx.array(values), mx.array(queries)
    kc, kn = quantize_kv(K, rot, levels, bits, norm_correction=norm_correction)
    vc, vn = quantize_kv(V, rot, levels, bits, norm_correction=norm_correction)
    scale = 1 / math.sqrt(d)
    o_rot, _ = packed_attention(rot.forward_queries(Q), kc, kn, vc, vn, levels, bits=bits, scale=scale,
                                offset=T, causal=False, valid_len=T)
    out = rot.inverse_queries(o_rot)
    ref = reference_attention(Q, K, V, scale=scale)
    Kh = dequantize_kv(kc, kn, rot, levels, bits, d)
    # Per (head): relative errors, averaged over queries / tokens.
    rel = lambda a, b, ax: np.linalg.norm(a - b, axis=ax) / np.linalg.norm(b, axis=ax)
    out, ref, Kh = np.array(out), np.array(ref), np.array(Kh)
    s_ref = np.einsum("bhld,bhtd->bhlt", queries, np.repeat(keys, queries.shape[1] // H, 1))
    s_q = np.einsum("bhld,bhtd->bhlt", queries, np.repeat(Kh, queries.shape[1] // H, 1))
    G = queries.shape[1] // H
    per_kv_head = lambda e: e.reshape(H, -1).mean(-1)  # query heads h*G..h*G+G-1 share kv head h
    return {
        "key_rel_err": per_kv_head(rel(Kh, keys, -1)[0]),
        "score_rel_err": per_kv_head(rel(s_q, s_ref, -1)[0]),
        "out_rel_err": per_kv_head(rel(out, ref, -1)[0]),
    }


def run(args):
    d, T, H, G, L = args.dim, args.tokens, args.kv_heads, args.group, args.queries
    cb = sphere_codebook(args.bits, d)
    rows = {}
    for scenario in ("zero-mean", "biased"):
        for variant in VARIANTS:
            for nc in (True, False):
                acc = []
                for layer in range(args.layers):
                    rng = np.random.default_rng([args.seed, layer])
                    keys = make_keys(rng, H, T, d, args.outliers, 10.0, 50.0, scenario == "biased")
                    values = rng.standard_normal((1, H, T, d)).astype(np.float32)
                    queries = rng.standard_normal((1, H * G, L, d)).astype(np.float32)
                    acc.append(measure(variant, keys, values, queries, layer, args.bits, nc, cb))
                # one value per (layer, kv head): each has its own rotation parameters
                rows[(scenario, variant, nc)] = {k: np.concatenate([a[k] for a in acc]) for k in acc[0]}
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--group", type=int, default=2, help="query heads per kv head")
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--outliers", type=int, default=4, help="outlier channels per head")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.time()
    rows = run(args)
    n = args.layers * args.kv_heads
    lines = [f"{args.bits}-bit K+V, d={args.dim}, T={args.tokens}, {args.kv_heads} kv heads × {args.layers} layers "
             f"(n={n} rotations per cell, mean ± s.e.), {args.outliers} outlier channels 10-50×, "
             f"{args.kv_heads * args.group} q heads × {args.queries} queries; mlx {mx.__version__}, "
             f"{platform.machine()}, {time.time() - t0:.0f} s", "",
             "| keys | rotation | key rel err | score rel err | out rel err, norm corr. | out rel err, plain norm | "
             "Δ out err vs wht_so4 (paired, plain) | wht_so4 better in |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    ms = lambda x: f"{x.mean():.4f} ± {x.std(ddof=1) / math.sqrt(x.size):.4f}"
    best = {}
    for scenario in ("zero-mean", "biased"):
        base = rows[(scenario, "wht_so4", False)]["out_rel_err"]
        best[scenario] = min(VARIANTS, key=lambda v: rows[(scenario, v, False)]["out_rel_err"].mean())
        for v in VARIANTS:
            a, b = rows[(scenario, v, True)], rows[(scenario, v, False)]
            diff = "" if v == "wht_so4" else ms(b["out_rel_err"] - base)
            wins = "" if v == "wht_so4" else f"{np.sum(base < b['out_rel_err'])}/{n}"
            lines.append(f"| {scenario} | {v} | {ms(b['key_rel_err'])} | {ms(b['score_rel_err'])} | "
                         f"{ms(a['out_rel_err'])} | {ms(b['out_rel_err'])} | {diff} | {wins} |")
    lines += ["", "Norm correction minus plain norm, out rel err (paired over rotations; > 0: correction is worse):", ""]
    for scenario in ("zero-mean", "biased"):
        lines.append(f"- {scenario}: " + ", ".join(
            f"{v} {ms(rows[(scenario, v, True)]['out_rel_err'] - rows[(scenario, v, False)]['out_rel_err'])}"
            for v in VARIANTS))
    lines += ["", "Lowest mean output error (plain norm): " + ", ".join(f"{s}: {v}" for s, v in best.items())]
    print("\n".join(lines))
    from _readme import save

    data = [{"scenario": sc, "rotation": v, "norm_correction": nc, **{k: float(x.mean()) for k, x in r.items()}}
            for (sc, v, nc), r in rows.items()]
    save("rotation_error", {"cpu": _cpu(), "rows": data}, "\n".join(lines), ROOT / "tools" / "rotation_error.json")


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

if __name__ == "__main__":
    main()
