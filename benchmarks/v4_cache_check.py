"""The compressed caches' GPU attention paths agree: RQ_ATTN=v3 (default), v3r and v4 (docs/KERNEL_NOTES.md).

Builds identical IsoQuant-3 / TurboQuant-3 caches (same seed, same random prompt K/V), compresses the
prompt, then decodes a few tokens through `cache.attend` once per RQ_ATTN value and compares each
output with the float64 math on the same cache contents (dequantize, rotate back, softmax). On CPU
every value takes the reference path (fused_attend returns None), so this also runs here.

    python3 benchmarks/v4_cache_check.py [--context 5000] [--steps 3] [--prefill-chunk 1024 --prefill-fp16 4096]

Exit status 1 if any relative error exceeds --tol or any output is not finite.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from rq_core import kernels as K  # noqa: E402
from rq_core.kv_cache import IsoQuantCache, TurboQuantCache, dequantize_kv, quantize_kv  # noqa: E402

HQ, HKV, D = 32, 4, 128


def reference(cache, q: np.ndarray, scale: float, half: bool = False) -> np.ndarray:
    """float64 attention of q [1, HQ, L, D] over everything the cache holds (the packed tokens, then the fp16 segment);
    with L > 1 the queries are the last L tokens, causally (query i sees keys up to its own position).

    half: with the codebook levels rounded to float16, as the GPU's matrix units use them."""
    n = cache.packed_len
    lv = cache.levels.astype(mx.float16).astype(mx.float32) if half else cache.levels
    klv = cache.k_levels.astype(mx.float16).astype(mx.float32) if half else cache.k_levels  # keys' own (pair) codebook
    with mx.stream(mx.cpu):  # float32 dequantization on the CPU, then float64 math
        k = np.array(dequantize_kv(cache.k_codes[:, :, :n], cache.k_norms[:, :, :n], cache.rotation, klv,
                                   cache.key_bits or cache.bits, D), dtype=np.float64)
        v = np.array(dequantize_kv(cache.v_codes[:, :, :n], cache.v_norms[:, :, :n], cache.rotation, lv,
                                   cache.bits, D), dtype=np.float64)
    if cache.fp16_len:  # the fp16 window after the packed tokens, exact
        fk, fv = cache._fp16()
        k = np.concatenate([k, np.array(fk.astype(mx.float32), dtype=np.float64)], 2)
        v = np.concatenate([v, np.array(fv.astype(mx.float32), dtype=np.float64)], 2)
    G = HQ // HKV
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = np.einsum("bhld,bhtd->bhlt", q.astype(np.float64), k) * scale
    L, T = q.shape[2], k.shape[2]
    s = np.where(np.arange(T)[None, :] <= (T - L + np.arange(L))[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhlt,bhtd->bhld", p, v)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bits", type=int, default=3, help="the caches' bits (scalar codebooks; 4: an edge layer's, "
                    "kv.edge_layers)")
    ap.add_argument("--window", type=int, default=0, help="the caches' fp16_window (v4 merges it in-kernel)")
    ap.add_argument("--rotation", default="wht_so4", help="the IsoQuant cache's rotation (e.g. rwht_so4)")
    ap.add_argument("--pair-points", default="", help="K,V: pair codebooks (kv.pair_points), e.g. 128,32")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="the prompt in chunks of this many tokens with as "
                    "many causal queries (past kv.prefill_fp16 the older tokens are compressed as the chunks arrive)")
    ap.add_argument("--prefill-fp16", type=int, default=4096, help="kv.prefill_fp16 with --prefill-chunk")
    ap.add_argument("--no-value-gain", action="store_true", help="caches without kv.value_gain (their values' norms unscaled)")
    ap.add_argument("--tol", type=float, default=3e-3, help="against the exact or the half-rounded levels "
                    "(the GPU's matrix units see the latter); fp16 queries and output")
    a = ap.parse_args()
    print(f"v4_cache_check: backend {K.backend()}, MLX {mx.__version__}, context {a.context}, "
          f"fp16 window {a.window}", flush=True)
    rng = np.random.default_rng(0)
    kp = rng.standard_normal((1, HKV, a.context, D)).astype(np.float16)
    vp = rng.standard_normal((1, HKV, a.context, D)).astype(np.float16)
    steps = [(rng.standard_normal((1, HQ, 1, D)).astype(np.float16), rng.standard_normal((1, HKV, 1, D)).astype(
        np.float16), rng.standard_normal((1, HKV, 1, D)).astype(np.float16)) for _ in range(a.steps)]
    scale = 1.0 / math.sqrt(D)
    fails = 0
    for label, cls in (("isoquant3", IsoQuantCache), ("turbo3", TurboQuantCache)):
        for version in [v for v in os.environ.get("RQ_CHECK_VERSIONS", "v3,v3r,v4,v5").split(",") if v]:
            os.environ["RQ_ATTN"] = version
            kw = {"rotation": a.rotation} if cls is IsoQuantCache else {}
            kw["bits"] = a.bits
            if a.pair_points:
                kw["pair_points"] = tuple(int(x) for x in a.pair_points.split(","))
            if a.prefill_chunk:
                kw["prefill_fp16"] = a.prefill_fp16
            cache = cls(head_dim=D, n_kv_heads=HKV, layer=3, fp16_window=a.window, value_gain=not a.no_value_gain, **kw)
            if a.prefill_chunk:
                for s0 in range(0, a.context, a.prefill_chunk):
                    s1 = min(a.context, s0 + a.prefill_chunk)
                    qc = mx.array(rng.standard_normal((1, HQ, s1 - s0, D)).astype(np.float16))
                    o = cache.attend(qc, mx.array(kp[:, :, s0:s1]), mx.array(vp[:, :, s0:s1]), scale=scale,
                                     mask="causal")
                    ok = bool(np.isfinite(np.array(o.astype(mx.float32))).all()) and cache.fp16_len <= max(
                        s1 - s0, cache.prefill_fp16)
                    fails += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {label:9s} RQ_ATTN={version:3s} prompt in chunks of {a.prefill_chunk}: "
                      f"{cache.packed_len} tokens compressed while prefilling, {cache.fp16_len} fp16", flush=True)
                if cache.packed_len:  # the last chunk's last 16 rows (over packed and fp16 tokens) against float64
                    qs = np.array(qc[:, :, -16:].astype(mx.float32))
                    got = np.array(o[:, :, -16:].astype(mx.float32), dtype=np.float64)
                    err = min(float(np.linalg.norm(got - r) / np.linalg.norm(r))
                              for r in (reference(cache, qs, scale), reference(cache, qs, scale, half=True)))
                    ok = err < a.tol
                    fails += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} {label:9s} RQ_ATTN={version:3s} last prompt chunk's rows: rel. err "
                          f"{err:.2e}", flush=True)
            else:
                qp = mx.array(rng.standard_normal((1, HQ, 1, D)).astype(np.float16))
                mx.eval(cache.attend(qp, mx.array(kp), mx.array(vp), scale=scale, mask="causal"))  # prompt: fp16 SDPA
            cache.end_prefill()
            # the stored codes (kv_append on a GPU) against quantize_kv on the CPU: equal but for near-ties
            n = cache.packed_len
            with mx.stream(mx.cpu):
                ref_k = quantize_kv(mx.array(kp[:, :, :n]), cache.rotation, cache.k_levels, cache.key_bits or cache.bits)
                ref_v = quantize_kv(mx.array(vp[:, :, :n]), cache.rotation, cache.levels, cache.bits)
            diff = sum(int((np.array(c[:, :, :n]) != np.array(r)).sum())
                       for c, r in ((cache.k_codes, ref_k[0]), (cache.v_codes, ref_v[0])))
            words = int(np.array(ref_k[0]).size + np.array(ref_v[0]).size)
            ok = diff <= max(2, words // 10000)
            fails += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {label:9s} RQ_ATTN={version:3s} stored codes: {diff} of {words} words "
                  f"differ from quantize_kv's", flush=True)
            # the values' stored norms: quantize_kv's times the codebook's reconstruction gain (kv.value_gain)
            vn = np.array(cache.v_norms[:, :, :n].astype(mx.float32), dtype=np.float64)
            want = np.array(ref_v[1].astype(mx.float32), dtype=np.float64) * cache.v_gain
            err = float(np.abs(vn - want).max() / np.abs(want).max())
            ok = err < 2e-3
            fails += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {label:9s} RQ_ATTN={version:3s} values' norms: gain {cache.v_gain:.4f}, "
                  f"max rel. err {err:.1e}", flush=True)
            for i, (q, k, v) in enumerate(steps):
                out = cache.attend(mx.array(q), mx.array(k), mx.array(v), scale=scale, mask="causal")
                mx.eval(out)
                got = np.array(out.astype(mx.float32), dtype=np.float64)
                ref = reference(cache, q, scale)
                err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                ref_h = reference(cache, q, scale, half=True)
                err_h = float(np.linalg.norm(got - ref_h) / np.linalg.norm(ref_h))
                ok = bool(np.isfinite(got).all()) and min(err, err_h) < a.tol and out.dtype == mx.float16
                fails += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {label:9s} RQ_ATTN={version:3s} step {i}  rel.err {err:.2e}  "
                      f"(half levels {err_h:.2e})  dtype {out.dtype}", flush=True)
    os.environ.pop("RQ_ATTN", None)
    print(f"v4_cache_check: {'all passed' if not fails else f'{fails} failed'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
