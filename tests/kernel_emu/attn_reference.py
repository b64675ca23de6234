"""float64 reference math of compressed-space attention, written from docs/FORMAT.md alone, and random cases.

Every case draws fresh random inputs (queries, codes, norms, rotations, a random ascending codebook); rows past the
valid length hold garbage codes and large norms: they must be ignored. Used by the tests (the kernels' CUDA renderings
on the CPU executor, tests/kernel_emu/emulate.py) and by tools/gpu_check.py (the kernels on a GPU).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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


def run_case(K, mx, c, *, T, bits, path, causal, offset, rot, strategy=None, qdtype="f32", key_bits=None,
             fused_config=None):
    """One case through the kernels (module K, rq_core.kernels.launch): path "fused" (fused_attention; fused_config: its
    nth / pf / vdec / stage overrides) or "four" (the four-kernel pipeline with value_accum's `strategy`).
    Returns (relative error against float64, NaN count, relative error against float64 with the codebook levels
    rounded to half as the matrix units see them; None for the four-kernel path, which is fp32 throughout)."""
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
    if path == "fused":  # out in q's dtype (compared in float64)
        out, lse = K.fused_attention(qq, m, kc, kn, vc, vn, lv, **(fused_config or {}), **split, **args)
        mx.eval(out, lse)
        out = out.astype(mx.float32)
    elif path == "four":
        out = K.attention_four(qq, m, kc, kn, vc, vn, lv, strategy=strategy or "auto", **split, **args)
        mx.eval(out)
    else:
        raise ValueError(f"unknown path {path!r} (fused, four)")
    got = np.array(out, dtype=np.float64)
    ref = reference(q, mats, c["kidx"], c["knorm"], c["vidx"], c["vnorm"], c["levels"], scale=args["scale"],
                    offset=offset, causal=causal, T=T, rot=rot, key_levels=c["klevels"])
    nan = int(np.isnan(got).sum())
    err = float(np.linalg.norm(np.nan_to_num(got) - ref) / np.linalg.norm(ref))
    if path != "fused":
        return err, nan, None
    # the matrix units see the codebook levels rounded to half (queries and weights stay exact to ~2^-22 through
    # hi + lo halves): against that math they must agree to fp32 accuracy at any context
    ref_h = reference(q, mats, c["kidx"], c["knorm"], c["vidx"], c["vnorm"], half_levels(c["levels"]),
                      scale=args["scale"], offset=offset, causal=causal, T=T, rot=rot,
                      key_levels=half_levels(c["klevels"]))
    return err, nan, float(np.linalg.norm(np.nan_to_num(got) - ref_h) / np.linalg.norm(ref_h))
