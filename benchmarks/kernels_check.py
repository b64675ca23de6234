"""GPU correctness of the compressed-attention kernels against float64 reference math (docs/FORMAT.md).

Every case draws fresh random inputs (queries, codes, norms, rotations, a random ascending codebook),
poisons the kernels' outputs with NaN before they run (rq_core.kernels.POISON), and compares the
result with a float64 numpy implementation written from FORMAT.md alone, by ‖out − ref‖ / ‖ref‖.
Rows past the valid length hold garbage codes and large norms: they must be ignored.

    python3 benchmarks/kernels_check.py [--quick] [--out DIR]

Exit status 1 if any case fails (error above --tol, or any NaN).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# ---------------------------------------------------------------------------------------------
# float64 reference, from docs/FORMAT.md only


def wht64(x: np.ndarray) -> np.ndarray:
    """Normalised Sylvester WHT over the last axis by butterflies."""
    x = np.array(x, dtype=np.float64)
    d = x.shape[-1]
    h = 1
    while h < d:
        y = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        x = y.reshape(*x.shape[:-1], d)
        h *= 2
    return x / math.sqrt(d)


def quat_L(q: np.ndarray) -> np.ndarray:
    """Matrix of v ↦ q ⊗ v (Hamilton), q = (w, x, y, z) along the last axis."""
    w, x, y, z = np.moveaxis(q, -1, 0)
    return np.stack([np.stack([w, -x, -y, -z], -1), np.stack([x, w, -z, y], -1),
                     np.stack([y, z, w, -x], -1), np.stack([z, -y, x, w], -1)], -2)


def quat_R(p: np.ndarray) -> np.ndarray:
    """Matrix of v ↦ v ⊗ p."""
    w, x, y, z = np.moveaxis(p, -1, 0)
    return np.stack([np.stack([w, -x, -y, -z], -1), np.stack([x, w, z, -y], -1),
                     np.stack([y, -z, w, x], -1), np.stack([z, y, -x, w], -1)], -2)


def random_block_matrices(rng: np.random.Generator, hkv: int, d: int) -> np.ndarray:
    """[Hkv, d/4, 4, 4]: M_j = L(q_L) · R(conj q_R) for random unit quaternions."""
    g = rng.standard_normal((hkv, d // 4, 2, 4))
    g /= np.linalg.norm(g, axis=-1, keepdims=True)
    qL, qR = g[..., 0, :], g[..., 1, :]
    conj = qR * np.array([1.0, -1.0, -1.0, -1.0])
    return quat_L(qL) @ quat_R(conj)


def rotate64(x: np.ndarray, mats: np.ndarray | None, hk: np.ndarray, rot: int, inverse: bool) -> np.ndarray:
    """x [..., H, L, d] with head h using mats[hk[h]]: forward R_SO4(H_d(x)), inverse H_d(R_SO4ᵀ(x))."""
    d = x.shape[-1]
    if not inverse and rot & 1:
        x = wht64(x)
    if rot & 2:
        M = mats[hk]  # [H, d/4, 4, 4]
        if inverse:
            M = np.swapaxes(M, -1, -2)
        xb = x.reshape(*x.shape[:-1], d // 4, 4)
        x = np.einsum("hjab,...hljb->...hlja", M, xb).reshape(x.shape)
    if inverse and rot & 1:
        x = wht64(x)
    return x


def pack64(idx: np.ndarray, bits: int) -> np.ndarray:
    """Little-endian bit stream per row: index i at bits [b·i, b·i + b) → uint32 words."""
    n = idx.shape[-1]
    bitarr = ((idx[..., :, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(*idx.shape[:-1], n * bits)
    nw = -(-n * bits // 32)
    pad = nw * 32 - n * bits
    if pad:
        bitarr = np.concatenate([bitarr, np.zeros((*bitarr.shape[:-1], pad), np.uint8)], -1)
    by = np.packbits(bitarr, axis=-1, bitorder="little")
    return by.view("<u4").reshape(*idx.shape[:-1], nw)


def reference(q, mats, kidx, knorm, vidx, vnorm, levels, *, scale, offset, causal, T, rot) -> np.ndarray:
    """o = Rᵀ softmax(scale · m_j ⟨R q, levels[kidx_j]⟩ / √d) · Σ α_j m'_j levels[vidx_j] / √d, float64."""
    B, Hq, L, d = q.shape
    Hkv = kidx.shape[1]
    G = Hq // Hkv
    hk = np.arange(Hq) // G
    lv = levels.astype(np.float64)
    qt = rotate64(q.astype(np.float64), mats, hk, rot, False)
    K = lv[kidx[:, :, :T]] * knorm[:, :, :T, None].astype(np.float64) / math.sqrt(d)
    V = lv[vidx[:, :, :T]] * vnorm[:, :, :T, None].astype(np.float64) / math.sqrt(d)
    K, V = K[:, hk], V[:, hk]
    s = np.einsum("bhld,bhtd->bhlt", qt, K) * scale
    if causal:
        vis = np.arange(T)[None, :] <= (offset + np.arange(L))[:, None]
        s = np.where(vis, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhlt,bhtd->bhld", p, V)
    return rotate64(o, mats, hk, rot, True)


# ---------------------------------------------------------------------------------------------


def make_case(rng, *, B, Hkv, G, L, d, T, bits, slack=5):
    Tcap = T + slack
    nl = 1 << bits
    levels = np.sort(rng.standard_normal(nl) * 1.2).astype(np.float32)
    kidx = rng.integers(0, nl, (B, Hkv, Tcap, d))
    vidx = rng.integers(0, nl, (B, Hkv, Tcap, d))
    knorm = rng.uniform(0.5, 3.0, (B, Hkv, Tcap)).astype(np.float16)
    vnorm = rng.uniform(0.5, 3.0, (B, Hkv, Tcap)).astype(np.float16)
    knorm[:, :, T:] = 1000.0  # rows past the valid length must not count
    vnorm[:, :, T:] = 1000.0
    q = rng.standard_normal((B, Hkv * G, L, d)).astype(np.float32) * 2.0
    mats = random_block_matrices(rng, Hkv, d)
    return dict(q=q, mats=mats, levels=levels, kidx=kidx, vidx=vidx, knorm=knorm, vnorm=vnorm, Tcap=Tcap)


def run_case(K, mx, c, *, T, bits, path, strategy, causal, offset, rot, mma=False, qdtype="f32", variant=None):
    q, mats = c["q"], c["mats"]
    args = dict(bits=bits, scale=1.0 / math.sqrt(q.shape[-1]), valid_len=T, offset=offset, causal=causal, rot=rot)
    kc = mx.array(pack64(c["kidx"], bits))
    vc = mx.array(pack64(c["vidx"], bits))
    kn, vn = mx.array(c["knorm"]), mx.array(c["vnorm"])
    lv = mx.array(c["levels"])
    m = mx.array(mats.astype(np.float32)) if rot & 2 else None
    qq = mx.array(q)
    if qdtype == "f16":
        qq = qq.astype(mx.float16)
        q = np.array(qq, dtype=np.float64)
    if path == "fused":
        out, lse = K.attention_split(qq, m, kc, kn, vc, vn, lv, mma=mma, variant=variant, **args)
        mx.eval(out, lse)
    else:
        out = K.attention_four(qq, m, kc, kn, vc, vn, lv, strategy=strategy, **args)
        mx.eval(out)
    got = np.array(out, dtype=np.float64)
    ref = reference(q, mats, c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"], scale=args["scale"],
                    offset=offset, causal=causal, T=T, rot=rot)
    nan = int(np.isnan(got).sum())
    err = float(np.linalg.norm(np.nan_to_num(got) - ref) / np.linalg.norm(ref))
    return err, nan


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the main shape")
    ap.add_argument("--tol", type=float, default=1e-4, help="fp32 paths")
    ap.add_argument("--tol-mma", type=float, default=2e-3, help="matrix-unit path (codebook levels in half)")
    ap.add_argument("--only", default="", help="comma-separated paths to run: fused, four, mma")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import mlx.core as mx

    import rq_core.kernels as K

    if not K.available():
        print("kernels_check: no GPU backend here (MLX device:", mx.default_device(), ")")
        return 0
    K.POISON = True
    print(f"kernels_check: backend {K.backend()}, MLX {mx.__version__}")
    rng = np.random.default_rng(int(time.time()))
    cases = []
    # the matrix-unit fused kernel with double-buffered rows (the default)
    for T in (1, 7, 513, 4096, 131072):
        cases.append(dict(G=8, d=128, T=T, L=1, path="mma2", strategy=None, causal=False, rot=3, bits=3))
    cases.append(dict(G=8, d=128, T=4099, L=1, path="mma2", strategy=None, causal=False, rot=3, bits=3, qdtype="f16"))
    cases.append(dict(G=1, d=128, T=513, L=1, path="mma2", strategy=None, causal=False, rot=3, bits=3))
    cases.append(dict(G=8, d=256, T=4097, L=1, path="mma2", strategy=None, causal=False, rot=3, bits=3))
    cases.append(dict(G=4, d=128, T=700, L=2, path="mma2", strategy=None, causal=True, rot=3, bits=3))
    cases.append(dict(G=8, d=128, T=3000, L=1, path="mma2", strategy=None, causal=False, rot=0, bits=3))
    # the matrix-unit fused kernel: main shape at every context, then the other shapes it covers
    for T in (1, 7, 511, 512, 513, 4096, 32768, 131072):
        cases.append(dict(G=8, d=128, T=T, L=1, path="mma", strategy=None, causal=False, rot=3, bits=3))
    cases.append(dict(G=8, d=128, T=4099, L=1, path="mma", strategy=None, causal=False, rot=3, bits=3, qdtype="f16"))
    for G in (1, 4):
        cases.append(dict(G=G, d=128, T=513, L=1, path="mma", strategy=None, causal=False, rot=3, bits=3))
    cases.append(dict(G=8, d=256, T=4097, L=1, path="mma", strategy=None, causal=False, rot=3, bits=3))
    cases.append(dict(G=4, d=256, T=513, L=1, path="mma", strategy=None, causal=False, rot=3, bits=3))
    cases.append(dict(G=8, d=64, T=2000, L=1, path="mma", strategy=None, causal=False, rot=3, bits=4))
    cases.append(dict(G=4, d=128, T=700, L=2, path="mma", strategy=None, causal=True, rot=3, bits=3))
    cases.append(dict(G=8, d=128, T=3000, L=1, path="mma", strategy=None, causal=False, rot=0, bits=3))
    # main shape (Qwen3-30B-A3B: G = 8, d = 128), every context, every path
    for T in (1, 7, 511, 512, 513, 4096, 32768):
        for path, strat in (("fused", None), ("four", "word"), ("four", "dim")):
            cases.append(dict(G=8, d=128, T=T, L=1, path=path, strategy=strat, causal=False, rot=3, bits=3))
    if not a.quick:
        for G in (1, 4, 8):
            for d in (64, 128, 256):
                for path, strat in (("fused", None), ("four", "word"), ("four", "dim")):
                    cases.append(dict(G=G, d=d, T=513, L=1, path=path, strategy=strat, causal=False, rot=3, bits=3))
        for d in (64, 256):
            cases.append(dict(G=4, d=d, T=40000, L=1, path="fused", strategy=None, causal=False, rot=3, bits=3))
        # several query positions with a causal mask, other bit widths, no rotation (H1's contract)
        for path, strat in (("fused", None), ("four", "word"), ("four", "dim")):
            cases.append(dict(G=4, d=128, T=700, L=3, path=path, strategy=strat, causal=True, rot=3, bits=3))
        for bits in (2, 4):
            cases.append(dict(G=8, d=128, T=1500, L=1, path="fused", strategy=None, causal=False, rot=3, bits=bits))
            cases.append(dict(G=8, d=128, T=1500, L=1, path="four", strategy="dim", causal=False, rot=3, bits=bits))
        cases.append(dict(G=8, d=128, T=3000, L=1, path="fused", strategy=None, causal=False, rot=0, bits=3))
        cases.append(dict(G=8, d=128, T=3000, L=1, path="fused", strategy=None, causal=False, rot=1, bits=3))
    results, fails = [], 0
    t_all = time.time()
    if a.only:
        keep = set(a.only.split(","))
        cases = [cs for cs in cases if cs["path"] in keep]
    for cs in cases:
        c = make_case(rng, B=1, Hkv=2, G=cs["G"], L=cs["L"], d=cs["d"], T=cs["T"], bits=cs["bits"])
        offset = cs["T"] - cs["L"]
        t0 = time.time()
        try:
            mma = cs["path"] in ("mma", "mma2")
            err, nan = run_case(K, mx, c, T=cs["T"], bits=cs["bits"], path="fused" if mma else cs["path"],
                                strategy=cs["strategy"], causal=cs["causal"], offset=offset, rot=cs["rot"], mma=mma,
                                qdtype=cs.get("qdtype", "f32"), variant=cs["path"] if mma else None)
            ok = nan == 0 and err < (a.tol_mma if mma else a.tol)
            msg = ""
        except Exception as e:  # a compile or launch error is a failure, reported, not a crash
            err, nan, ok, msg = float("nan"), -1, False, f"{type(e).__name__}: {str(e)[:300]}"
        fails += not ok
        r = dict(cs, err=err, nan=nan, ok=ok, secs=round(time.time() - t0, 2), error=msg)
        results.append(r)
        name = f"{cs['path']}{'/' + cs['strategy'] if cs['strategy'] else ''}"
        name += "/f16q" if cs.get("qdtype") == "f16" else ""
        print(f"{'ok  ' if ok else 'FAIL'} {name:9s} G={cs['G']} d={cs['d']:3d} T={cs['T']:6d} L={cs['L']} "
              f"bits={cs['bits']} rot={cs['rot']} causal={int(cs['causal'])}  rel.err {err:.2e}  nan {nan}  "
              f"{r['secs']:.1f}s {msg}", flush=True)
    print(f"kernels_check: {len(cases) - fails}/{len(cases)} passed in {time.time() - t_all:.0f}s; "
          f"max rel.err {max(r['err'] for r in results if r['ok']) if len(cases) > fails else float('nan'):.2e}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "kernels_check.json").write_text(json.dumps(results, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
