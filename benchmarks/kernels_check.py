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
    """x [..., H, L, d] with head h using mats[hk[h]]: forward R_SO4(H_d(x)), inverse H_d(R_SO4ᵀ(x)).

    rot bit 4: a dense rotation, mats [Hkv, d, d] with y = P x (TurboQuant); inverse Pᵀ y.
    """
    d = x.shape[-1]
    if rot & 4:
        P = mats[hk]  # [H, d, d]
        return np.einsum("hba,...hlb->...hla" if inverse else "hab,...hlb->...hla", P, x)
    sg = None
    if rot & 8:  # rwht_so4: mats [Hkv, 5d] = each head's blocks, then its signs (applied before the WHT)
        mats = np.asarray(mats)
        sg = mats[:, 4 * d:][hk][..., None, :]  # [H, 1, d]
        mats = mats[:, :4 * d].reshape(-1, d // 4, 4, 4)
        if not inverse:
            x = x * sg
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
    if sg is not None and inverse:
        x = x * sg
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


def reference(q, mats, kidx, knorm, vidx, vnorm, levels, *, scale, offset, causal, T, rot,
              key_levels=None) -> np.ndarray:
    """o = Rᵀ softmax(scale · m_j ⟨R q, levels[kidx_j]⟩ / √d) · Σ α_j m'_j levels[vidx_j] / √d, float64.
    key_levels: the keys' own codebook (keys at their own width), else `levels`."""
    B, Hq, L, d = q.shape
    Hkv = kidx.shape[1]
    G = Hq // Hkv
    hk = np.arange(Hq) // G
    lv = levels.astype(np.float64)
    qt = rotate64(q.astype(np.float64), mats, hk, rot, False)
    klv = lv if key_levels is None else key_levels.astype(np.float64)
    K = klv[kidx[:, :, :T]] * knorm[:, :, :T, None].astype(np.float64) / math.sqrt(d)
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
# float64 emulation of attn_v4's algorithm, step by step as the kernel does it (metal/attn_v4.body):
# split boundaries, tiles, online softmax in log2 units with the NEG_BIG sentinel, per-split partials,
# the last block's log-sum-exp merge, the in-kernel rotation order. It checks the algorithm on CPU;
# the kernel itself has not run on a GPU.

NEG_BIG = -1.0e30


def wht_butterflies(x: np.ndarray) -> np.ndarray:
    """wht_rows: in-place butterflies (i, i + h) for h = 1, 2, ..., D/2, then 1/sqrt(D) (rows on axis 0)."""
    x = np.array(x, dtype=np.float64)
    D = x.shape[-1]
    h = 1
    while h < D:
        for t in range(D // 2):
            i = (t // h) * 2 * h + (t % h)
            a, b = x[..., i].copy(), x[..., i + h].copy()
            x[..., i], x[..., i + h] = a + b, a - b
        h *= 2
    return x / math.sqrt(D)


def emulate_v4(q, mats, kidx, knorm, vidx, vnorm, levels, *, scale, T, rot, ns, causal=False, tile=128,
               half_levels=False) -> tuple[np.ndarray, np.ndarray, dict]:
    """(out [B, Hq, L, d], lse [B, Hq, L], partials) as attn_v4 computes them, in float64.

    ns: the split count (the grid's y, rq_core.kernels.v4_plan). half_levels: round the codebook levels
    to float16 first, as the matrix units see them (the kernel splits queries and weights into hi + lo
    halves, so those stay exact to ~2^-22; not modelled).
    """
    B, Hq, L, D = q.shape
    Hkv = kidx.shape[1]
    G = Hq // Hkv
    R = G * L
    lv = levels.astype(np.float16 if half_levels else np.float64).astype(np.float64)
    qscale = scale * LOG2E / math.sqrt(D)
    ntiles = -(-T // tile)
    per = -(-ntiles // ns)
    out = np.zeros((B, Hq, L, D))
    lse = np.zeros((B, Hq, L))
    parts = {"o": np.zeros((B * Hkv, ns, R, D)), "m": np.zeros((B * Hkv, ns, R)), "l": np.zeros((B * Hkv, ns, R))}
    for b in range(B):
        for hk in range(Hkv):
            bh = b * Hkv + hk
            qt = q[b, hk * G:(hk + 1) * G].reshape(R, D).astype(np.float64)  # row n = g * L + l
            # prologue: WHT butterflies, then the SO(4) blocks (or P), then the score scale (log2 units)
            if rot & 1:
                qt = wht_butterflies(qt)
            if rot & 4:
                qt = qt @ mats[hk].T
            elif rot & 2:
                qt = np.einsum("jab,njb->nja", mats[hk], qt.reshape(R, D // 4, 4)).reshape(R, D)
            qs = qt * qscale
            lim = (T - L + np.arange(R) % L + 1) if causal else np.full(R, T)
            for split in range(ns):
                j0 = split * per * tile
                j1 = min(j0 + per * tile, T)
                m = np.full(R, NEG_BIG)
                l_ = np.zeros(R)
                acc = np.zeros((R, D))
                for tb in range(j0, j1, tile):
                    te = min(tb + tile, j1)
                    j = np.arange(tb, te)
                    K = lv[kidx[b, hk, tb:te]]
                    s = (qs @ K.T) * knorm[b, hk, tb:te].astype(np.float64)[None]
                    s = np.where(j[None, :] < lim[:, None], s, NEG_BIG)
                    mnew = np.maximum(m, s.max(1))
                    p = np.where(s > 0.5 * NEG_BIG, np.exp2(s - mnew[:, None]), 0.0)
                    f = np.exp2(m - mnew)
                    l_ = l_ * f + p.sum(1)
                    wgt = p * vnorm[b, hk, tb:te].astype(np.float64)[None]
                    acc = acc * f[:, None] + wgt @ lv[vidx[b, hk, tb:te]]
                    m = mnew
                parts["o"][bh, split], parts["m"][bh, split], parts["l"][bh, split] = acc, m, l_
            # epilogue (the last block): merge the splits, then SO(4)^T (or P^T), then the WHT
            pm, pl, po = parts["m"][bh], parts["l"][bh], parts["o"][bh]
            M = pm.max(0)
            w = np.where(pm > 0.5 * NEG_BIG, np.exp2(pm - M[None]), 0.0)  # [ns, R]
            den = (w * pl).sum(0)
            x = np.einsum("sr,srd->rd", w, po)
            x = np.where(den[:, None] > 0, x / np.where(den > 0, den, 1.0)[:, None] / math.sqrt(D), 0.0)
            ls = np.where(den > 0, (M + np.log2(np.where(den > 0, den, 1.0))) * math.log(2.0), -np.inf)
            if rot & 4:
                x = x @ mats[hk]
            elif rot & 2:
                x = np.einsum("jba,njb->nja", mats[hk], x.reshape(R, D // 4, 4)).reshape(R, D)
            if rot & 1:
                x = wht_butterflies(x)
            out[b, hk * G:(hk + 1) * G] = x.reshape(G, L, D)
            lse[b, hk * G:(hk + 1) * G] = ls.reshape(G, L)
    return out, lse, parts


LOG2E = 1.4426950408889634


def random_dense(rng: np.random.Generator, hkv: int, d: int) -> np.ndarray:
    """[Hkv, d, d] Haar orthogonal matrices (QR with signs fixed), as the `dense` rotation."""
    out = []
    for _ in range(hkv):
        qm, r = np.linalg.qr(rng.standard_normal((d, d)))
        out.append(qm * np.sign(np.diag(r)))
    return np.stack(out)


def half_levels(levels: np.ndarray) -> np.ndarray:
    """The codebook as the matrix-unit kernels use it: each level rounded to float16."""
    return levels.astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------


def make_case(rng, *, B, Hkv, G, L, d, T, bits, slack=5, dense=False, signs=False, key_bits=None, pair_points=None):
    """Random inputs of one attention case; signs (rot bit 8, rwht_so4): mats [Hkv, 5d], each head's SO(4)
    blocks then its random ±1 signs, as kernels.rotation_args lays them out. pair_points (PK, PV): pair codebooks,
    random points and pair indices (kpidx, vpidx); levels / klevels are then the points flattened and kidx / vidx
    the per-coordinate indices into them (2 p + 0 / 1), so the reference math is unchanged."""
    if pair_points:  # rows of 14 / 10 (7 / 5 at d = 64) words: a capacity of 4k tokens keeps heads 16-byte aligned
        slack += -(T + slack) % 4
    Tcap = T + slack
    nl = 1 << bits
    levels = np.sort(rng.standard_normal(nl) * 1.2).astype(np.float32)
    nlk = 1 << (key_bits or bits)
    klevels = np.sort(rng.standard_normal(nlk) * 1.2).astype(np.float32) if key_bits else levels
    kidx = rng.integers(0, nlk, (B, Hkv, Tcap, d))
    vidx = rng.integers(0, nl, (B, Hkv, Tcap, d))
    knorm = rng.uniform(0.5, 3.0, (B, Hkv, Tcap)).astype(np.float16)
    vnorm = rng.uniform(0.5, 3.0, (B, Hkv, Tcap)).astype(np.float16)
    knorm[:, :, T:] = 1000.0  # rows past the valid length must not count
    vnorm[:, :, T:] = 1000.0
    q = rng.standard_normal((B, Hkv * G, L, d)).astype(np.float32) * 2.0
    mats = random_dense(rng, Hkv, d) if dense else random_block_matrices(rng, Hkv, d)
    if signs:
        sg = np.where(rng.random((Hkv, d)) < 0.5, -1.0, 1.0)
        mats = np.concatenate([mats.reshape(Hkv, -1), sg], axis=1)
    c = dict(q=q, mats=mats, levels=levels, klevels=klevels, kidx=kidx, vidx=vidx, knorm=knorm, vnorm=vnorm,
             Tcap=Tcap)
    if pair_points:
        pk, pv = pair_points
        c["kpoints"] = (rng.standard_normal((pk, 2)) * 1.2).astype(np.float32)
        c["vpoints"] = (rng.standard_normal((pv, 2)) * 1.2).astype(np.float32)
        c["kpidx"] = rng.integers(0, pk, (B, Hkv, Tcap, d // 2))
        c["vpidx"] = rng.integers(0, pv, (B, Hkv, Tcap, d // 2))
        c["levels"], c["klevels"] = c["vpoints"].reshape(-1), c["kpoints"].reshape(-1)
        c["kidx"] = (2 * c["kpidx"][..., None] + np.arange(2)).reshape(B, Hkv, Tcap, d)
        c["vidx"] = (2 * c["vpidx"][..., None] + np.arange(2)).reshape(B, Hkv, Tcap, d)
    return c


def run_case(K, mx, c, *, T, bits, path, strategy, causal, offset, rot, mma=False, qdtype="f32", variant=None,
             v5cfg=None, key_bits=None):
    q, mats = c["q"], c["mats"]
    args = dict(bits=bits, scale=1.0 / math.sqrt(q.shape[-1]), valid_len=T, offset=offset, causal=causal, rot=rot)
    pair = "kpidx" in c  # pair codebooks: the fields are the pair indices, the tables the points [n, 2]
    kc = mx.array(pack64(c["kpidx"] if pair else c["kidx"], key_bits or bits))
    vc = mx.array(pack64(c["vpidx"] if pair else c["vidx"], bits))
    kn, vn = mx.array(c["knorm"]), mx.array(c["vnorm"])
    lv = mx.array(c["vpoints"] if pair else c["levels"])
    m = mx.array(mats.astype(np.float32)) if rot & 6 else None
    qq = mx.array(q)
    if qdtype in ("f16", "bf16"):
        qq = qq.astype(mx.float16 if qdtype == "f16" else mx.bfloat16)
        q = np.array(qq.astype(mx.float32), dtype=np.float64)
    split = dict(key_bits=key_bits, key_levels=mx.array(c["kpoints"] if pair else c["klevels"])) if key_bits else {}
    if path == "v4":  # one launch; out in q's dtype (compared in float64)
        out, lse = K.attention_v4(qq, m, kc, kn, vc, vn, lv, **args)
        mx.eval(out, lse)
        out = out.astype(mx.float32)
    elif path == "v5":  # v4's contract; v5cfg = (threads per block, launch bound) or None for the defaults
        nth, minb, pf, vdec, stage = (tuple(v5cfg) + (None,) * 5)[:5] if v5cfg else (None,) * 5
        out, lse = K.attention_v5(qq, m, kc, kn, vc, vn, lv, nth=nth, minb=minb, pf=pf, vdec=vdec, stage=stage,
                                  **split, **args)
        mx.eval(out, lse)
        out = out.astype(mx.float32)
    elif path == "fused":
        out, lse = K.attention_split(qq, m, kc, kn, vc, vn, lv, mma=mma, variant=variant, **args)
        mx.eval(out, lse)
    else:
        out = K.attention_four(qq, m, kc, kn, vc, vn, lv, strategy=strategy, **split, **args)
        mx.eval(out)
    got = np.array(out, dtype=np.float64)
    ref = reference(q, mats, c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"], scale=args["scale"],
                    offset=offset, causal=causal, T=T, rot=rot, key_levels=c["klevels"])
    nan = int(np.isnan(got).sum())
    err = float(np.linalg.norm(np.nan_to_num(got) - ref) / np.linalg.norm(ref))
    if not mma:
        return err, nan, None
    # the matrix-unit paths see the codebook levels rounded to half (queries and weights stay exact to
    # ~2^-22 through hi + lo halves): against that math they must agree to fp32 accuracy at any context
    ref_h = reference(q, mats, c["kidx"], c["knorm"], c["vidx"], c["vnorm"], half_levels(c["levels"]),
                      scale=args["scale"], offset=offset, causal=causal, T=T, rot=rot,
                      key_levels=half_levels(c["klevels"]))
    return err, nan, float(np.linalg.norm(np.nan_to_num(got) - ref_h) / np.linalg.norm(ref_h))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the main shape")
    ap.add_argument("--tol", type=float, default=1e-4, help="fp32 paths")
    ap.add_argument("--tol-mma", type=float, default=2e-3, help="matrix-unit paths against the exact levels")
    ap.add_argument("--tol-half", type=float, default=5e-5, help="matrix-unit paths against float64 math with the "
                    "codebook levels rounded to half as they see them (float32 output; v4's fp16 / bf16 output adds "
                    "its own rounding: 1e-3 / 8e-3). A matrix-unit case passes under either tolerance: the error "
                    "against the exact levels grows with context (their rounding is systematic while the output "
                    "averages out), the one against the half levels should stay at fp32 accuracy")
    ap.add_argument("--only", default="", help="comma-separated paths to run: v5, v4, mma2, mma, fused, four")
    ap.add_argument("--v5-configs", default="", help="extra attn_v5 configurations NTH:MINB[:PF[:VDEC[:STAGE]]] "
                    "(threads per block, launch bound, load-ahead depth, value decode, copy-ring stages; e.g. 256:2,512:1:1), each checked on the main shape at "
                    "513, 4096 and 32768 tokens")
    ap.add_argument("--quick-v5", action="store_true", help="v5: 9 cases in 4 shape classes (short device runs)")
    ap.add_argument("--bits", default="", help="comma-separated value widths: only the cases at these (e.g. 4)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import mlx.core as mx

    import rq_core.kernels as K

    if not K.available():
        print("kernels_check: no GPU backend here (MLX device:", mx.default_device(), ")")
        return 0
    K.POISON = True
    # v4's counters: a tiny ring, so slots are reused many times in this run and must come back zeroed
    # (cases run one at a time here, so no two launches in flight share a slot)
    K.COUNTER_POOL = 8
    print(f"kernels_check: backend {K.backend()}, MLX {mx.__version__}")
    rng = np.random.default_rng(int(time.time()))
    cases = []
    # the single-launch kernels: every context of the issue, the other GQA groups / head dims they cover,
    # query dtypes, causal, no rotation, the dense rotation, and three launches in a row (the counters must
    # come back zeroed: a stale counter gives NaN or garbage); v5 adds 2-bit codes and its configurations
    def one_launch(path: str) -> list[dict]:
        base = dict(G=8, d=128, L=1, path=path, strategy=None, causal=False, rot=3, bits=3)
        out = [dict(base, T=T) for T in (1, 7, 511, 512, 513, 4096, 32768, 131072)]
        out += [dict(base, G=G, T=513) for G in (1, 4)]
        out += [dict(base, d=256, T=4097), dict(base, d=64, T=2000, bits=4),
                dict(base, T=4099, qdtype="f16"), dict(base, T=4099, qdtype="bf16"),
                dict(base, G=4, T=700, L=2, causal=True), dict(base, T=3000, rot=0), dict(base, T=3000, rot=4),
                dict(base, T=3000, rot=11)]
        if path == "v5":
            out.append(dict(base, T=1500, bits=2))
            # 4-bit keys and values at head dim 128: the edge layers' caches (kv.edge_layers)
            out += [dict(base, T=T, bits=4) for T in (1, 513, 32768)] + [dict(base, G=4, T=700, L=2, causal=True, bits=4)]
            # keys at their own width (kv.key_bits): 4-bit keys with 3- and 2-bit values
            out += [dict(base, T=T, key_bits=4) for T in (1, 513, 4096, 32768)]
            out += [dict(base, T=1500, bits=2, key_bits=4), dict(base, G=4, T=700, L=2, causal=True, key_bits=4)]
            # pair codebooks (kv.pair_points (128, 32)): 7-bit key fields, 5-bit value fields
            pp = dict(base, bits=5, key_bits=7, pair=(128, 32))
            out += [dict(pp, T=T) for T in (1, 7, 513, 4096, 32768, 131072)]
            out += [dict(pp, T=4099, qdtype="f16"), dict(pp, G=4, T=700, L=2, causal=True), dict(pp, d=64, T=2000),
                    dict(pp, T=3000, rot=11)]
        return out + [dict(base, T=40000, repeat=3)]

    cases += one_launch("v5")
    for cfg in [x for x in a.v5_configs.split(",") if x]:
        v5cfg = tuple(int(v) for v in cfg.split(":"))
        for T in (513, 4096, 32768):
            cases.append(dict(G=8, d=128, T=T, L=1, path="v5", strategy=None, causal=False, rot=3, bits=3,
                              v5cfg=v5cfg))
    cases += one_launch("v4")
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
    # the four kernels with pair codebooks (128, 32: 7-bit key and 5-bit value fields) and with 4-bit keys beside
    # 3-bit values (kv.key_bits), both Kernel C strategies: what `rq profile` times for such caches
    for strat in ("word", "dim"):
        pp = dict(G=8, L=1, path="four", strategy=strat, causal=False, rot=3, bits=5, key_bits=7, pair=(128, 32))
        cases += [dict(pp, d=128, T=T) for T in (1, 513, 4096, 32768)]
        cases += [dict(pp, d=64, T=700), dict(pp, d=256, T=700), dict(pp, G=4, d=128, T=700, L=2, causal=True)]
        cases.append(dict(G=8, d=128, T=1500, L=1, path="four", strategy=strat, causal=False, rot=3, bits=3, key_bits=4))
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
    if a.bits:
        cases = [cs for cs in cases if str(cs["bits"]) in a.bits.split(",")]
    if a.quick_v5:  # the v5 cases that need the fewest compiles: main shape at 6 contexts, G = 1, bf16, causal
        cases = [cs for cs in cases if cs["path"] != "v5" or cs.get("v5cfg") or (
            (cs["G"], cs["d"], cs["bits"], cs["rot"]) == (8, 128, 3, 3) and cs["T"] in (1, 7, 513, 4096, 32768, 131072)
            and cs.get("qdtype", "f32") == "f32" and not cs["causal"] and "repeat" not in cs)
            or (cs["G"] == 1) or cs.get("qdtype") == "bf16" or cs["causal"] or cs.get("pair")]
    for cs in cases:
        c = make_case(rng, B=1, Hkv=2, G=cs["G"], L=cs["L"], d=cs["d"], T=cs["T"], bits=cs["bits"],
                      dense=bool(cs["rot"] & 4), signs=bool(cs["rot"] & 8), key_bits=cs.get("key_bits"),
                      pair_points=cs.get("pair"))
        offset = cs["T"] - cs["L"]
        t0 = time.time()
        try:
            mma = cs["path"] in ("mma", "mma2", "v4", "v5")
            err, nan, err_h = 0.0, 0, None
            path = cs["path"] if cs["path"] in ("v4", "v5", "four") else "fused"
            for _ in range(cs.get("repeat", 1)):  # v4: later launches reuse counter slots left zeroed
                e1, n1, h1 = run_case(K, mx, c, T=cs["T"], bits=cs["bits"], path=path, strategy=cs["strategy"],
                                      causal=cs["causal"], offset=offset, rot=cs["rot"], mma=mma,
                                      qdtype=cs.get("qdtype", "f32"), variant=cs["path"] if mma else None,
                                      v5cfg=cs.get("v5cfg"), key_bits=cs.get("key_bits"))
                err, nan = max(err, e1), nan + n1
                err_h = h1 if err_h is None or h1 is None else max(err_h, h1)
            if mma:
                tol, tol_x = a.tol_half, a.tol_mma
                if cs.get("qdtype") in ("f16", "bf16") and cs["path"] in ("v4", "v5"):  # output in the query dtype
                    tol, tol_x = (1e-3, 4e-3) if cs["qdtype"] == "f16" else (8e-3, 1.6e-2)
                ok = nan == 0 and (err_h < tol or err < tol_x)
            else:
                ok = nan == 0 and err < a.tol
            msg = ""
        except Exception as e:  # a compile or launch error is a failure, reported, not a crash
            err, err_h, nan, ok, msg = float("nan"), None, -1, False, f"{type(e).__name__}: {str(e)[:300]}"
        fails += not ok
        r = dict(cs, err=err, err_half=err_h, nan=nan, ok=ok, secs=round(time.time() - t0, 2), error=msg)
        results.append(r)
        name = f"{cs['path']}{'/' + cs['strategy'] if cs['strategy'] else ''}"
        name += f"/{cs['qdtype']}q" if cs.get("qdtype", "f32") != "f32" else ""
        name += "/" + ":".join(map(str, cs["v5cfg"])) if cs.get("v5cfg") else ""
        name += (f"/p{cs['pair'][0]}x{cs['pair'][1]}" if cs.get("pair") else f"/k{cs['key_bits']}" if cs.get("key_bits")
                 else "")
        print(f"{'ok  ' if ok else 'FAIL'} {name:9s} G={cs['G']} d={cs['d']:3d} T={cs['T']:6d} L={cs['L']} "
              f"bits={cs['bits']} rot={cs['rot']} causal={int(cs['causal'])}  rel.err {err:.2e}"
              f"{'' if err_h is None else f' (half levels {err_h:.1e})'}  nan {nan}  "
              f"{r['secs']:.1f}s {msg}", flush=True)
    print(f"kernels_check: {len(cases) - fails}/{len(cases)} passed in {time.time() - t_all:.0f}s; "
          f"max rel.err {max(r['err'] for r in results if r['ok']) if len(cases) > fails else float('nan'):.2e}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "kernels_check.json").write_text(json.dumps(results, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
