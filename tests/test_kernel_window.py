"""attn_v4w (v4 with the cache's fp16 window merged in-kernel) executed on the CPU by the kernel emulator
(benchmarks/emulate_kernel.py: the CUDA rendering compiled as host C++) against float64 math: packed
tokens dequantized, then the window's exact keys/values, one softmax over both."""

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import emulate_kernel as EK  # noqa: E402
import kernels_check as KC  # noqa: E402

import rq_core.kernels as K  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel emulator needs g++")


def run_v4w(rng, *, G: int, d: int, T: int, NW: int, L: int = 1, causal: bool = False, bits: int = 3,
            rot: int = 3, B: int = 1, Hkv: int = 2, blocks: int = 8) -> dict:
    c = KC.make_case(rng, B=B, Hkv=Hkv, G=G, L=L, d=d, T=T, bits=bits)
    scale = 1.0 / math.sqrt(d)
    qin, q64, kc, vc, consts, views = EK._case_inputs(c, T, bits, scale, "f32")
    wcap = NW + 3  # a cache buffer: rows past the window hold junk the kernel must not read
    wk = (rng.standard_normal((B, Hkv, wcap, d)) * 1.5).astype(np.float16)
    wv = (rng.standard_normal((B, Hkv, wcap, d)) * 1.5).astype(np.float16)
    wk[:, :, NW:] = 1000.0
    wv[:, :, NW:] = 1000.0
    for n in ("wk", "wv"):
        views[n] = ((B, Hkv, NW, d), (Hkv * wcap * d, wcap * d, d, 1))
    R, groups = G * L, B * Hkv
    ns = K.v4_plan(T, groups, blocks)
    template = [("TQ", "f32"), ("D", d), ("BITS", bits), ("R", R), ("LQ", L), ("HKV", Hkv), ("CAUSAL", 0),
                ("ROT", rot), ("NTH", K.NTH), ("TILE", K.MMA_TILE), ("WCAUSAL", int(causal and L > 1))]
    outs = EK.emulate("attn_v4w", template,
                      dict(q=qin, mats=c["mats"].astype(np.float32), consts=consts, k_codes=kc, k_norms=c["knorm"],
                           v_codes=vc, v_norms=c["vnorm"], counter=np.zeros(groups, np.uint32), wk=wk, wv=wv),
                      dict(out=((B, G * Hkv, L, d), "f32"), lse=((B, G * Hkv, L), "f32"),
                           o_part=((groups, ns, R, d), "f32"), ml_part=((groups, ns, R, 2), "f32")),
                      (groups, ns), K.NTH, views=views, types={"q": "f32", "out": "f32", "wk": "f16", "wv": "f16"})
    # float64 reference in the rotated space (scores and weights are rotation-invariant), rotated back
    hk = np.arange(G * Hkv) // G
    lv = KC.half_levels(c["levels"]).astype(np.float64)  # the levels as the matrix units see them
    qt = KC.rotate64(q64, c["mats"], hk, rot, False)
    Kp = lv[c["kidx"][:, :, :T]] * c["knorm"][:, :, :T, None].astype(np.float64) / math.sqrt(d)
    Vp = lv[c["vidx"][:, :, :T]] * c["vnorm"][:, :, :T, None].astype(np.float64) / math.sqrt(d)
    Kw = KC.rotate64(wk[:, :, :NW].astype(np.float64), c["mats"], np.arange(Hkv), rot, False)
    Vw = KC.rotate64(wv[:, :, :NW].astype(np.float64), c["mats"], np.arange(Hkv), rot, False)
    Ka, Va = np.concatenate([Kp, Kw], 2)[:, hk], np.concatenate([Vp, Vw], 2)[:, hk]
    s = np.einsum("bhld,bhtd->bhlt", qt, Ka) * scale
    if causal and L > 1:  # window token j (position T + j) is seen by query l iff j <= NW - L + l
        j = np.arange(T + NW) - T
        s = np.where(j[None, :] <= (NW - L + np.arange(L))[:, None], s, -np.inf)
    top = s.max(-1, keepdims=True)
    p = np.exp(s - top)
    ref = KC.rotate64(np.einsum("bhlt,bhtd->bhld", p / p.sum(-1, keepdims=True), Va), c["mats"], hk, rot, True)
    ref_lse = top[..., 0] + np.log(p.sum(-1))
    got = outs["out"].astype(np.float64)
    return dict(err=float(np.linalg.norm(np.nan_to_num(got, nan=1e9) - ref) / np.linalg.norm(ref)),
                lse_err=float(np.abs(outs["lse"] - ref_lse).max()), nan=int(np.isnan(got).sum()),
                counters=int(outs["counter_after"].sum()), ns=ns)


@pytest.mark.parametrize("case", [
    dict(G=4, d=128, T=300, NW=5),  # several splits merged, then a short window
    dict(G=2, d=64, T=130, NW=17, L=2, causal=True, bits=4),  # two queries, causal inside the window
    dict(G=4, d=256, T=40, NW=37, L=2, causal=True),  # window past one pass of the token loops, D = 256
])
def test_v4_window_matches_float64(case):
    r = run_v4w(np.random.default_rng(7), **case)
    assert r["nan"] == 0 and r["counters"] == 0
    assert r["err"] < 1e-5, r
    assert r["lse_err"] < 1e-4, r
