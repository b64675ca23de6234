"""kv_append (quantize + pack new K and V in one launch) against quantize_kv and float64 math.

Every case draws fresh K/V rows (fp16 by default; bf16, fp32, a zero row, a strided slice of a cache buffer with
batch 2), a fresh rotation seed and layer; the kernel's outputs start poisoned. The kernel's codes must equal
quantize_kv's (MLX ops, the reference) except for coordinates whose float64 z = sqrt(d) R x / |x| lies within TOL of
a codebook threshold; those are counted, any other difference fails. Codes are also checked the same way against
float64 math written from docs/FORMAT.md. Norms (float16) must equal quantize_kv's within one fp16 ulp and
float64's within half an ulp plus float32 error.

Used by the tests (the CUDA rendering on the CPU executor, `check_case(rng, case, "emu")`) and by
tools/gpu_check.py (the GPU, `check_case(rng, case, "gpu")`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TOL = 1e-5  # |z64 - threshold| below which a code may differ (float32 rounding of norm, WHT, blocks, dense sums)


# ---------------------------------------------------------------------------------------------
# cases


def _bf16_round(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (u.astype(np.uint32) << 16).view(np.float32)


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to the input dtype, held as float32 (every value exact in float32)."""
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        return _bf16_round(x)
    return x.astype(np.float32)


def make_rows(rng, shape, dtype: str, zero_row: bool) -> np.ndarray:
    """K/V-like rows: gaussian with per-row scales over two decades and a few outlier channels."""
    B, H, T, D = shape
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-2.0, 2.5, (B, H, T, 1)))
    out_ch = rng.choice(D, size=max(1, D // 32), replace=False)
    x[..., out_ch] *= rng.uniform(3, 12, out_ch.size)
    if zero_row:
        x[0, 0, -1] = 0.0  # n = 0: u = 0
    return _round(x, dtype)


def case_list(full: bool, gpu: bool) -> list[dict]:
    """The main grid (d x bits x wht_so4/dense x t in {1, 5}) plus variants, dtypes, views and sizes."""
    cases = []
    for d in (64, 128, 256):
        for bits in ((2, 3, 4) if full else (3,)):
            for variant in ("wht_so4", "dense"):
                for t in (1, 5):
                    cases.append(dict(d=d, bits=bits, variant=variant, t=t, zero_row=t == 5 and bits == 3))
    cases += [
        dict(d=128, bits=3, variant="wht", t=3),
        dict(d=64, bits=3, variant="so4", t=2),
        dict(d=128, bits=4, variant="so3", t=2),
        dict(d=128, bits=3, variant="wht_so4", t=5, nc=True, zero_row=True),
        dict(d=64, bits=2, variant="dense", t=1, nc=True),
        dict(d=128, bits=3, variant="wht_so4", t=5, dtype="bf16"),
        dict(d=256, bits=3, variant="dense", t=1, dtype="f32"),
        dict(d=128, bits=3, variant="wht_so4", t=5, B=2, view=True),
        dict(d=64, bits=3, variant="dense", t=3, B=2, view=True, dtype="bf16"),
        dict(d=64, bits=1, variant="wht_so4", t=5),
        dict(d=32, bits=3, variant="wht_so4", t=4),
        dict(d=512, bits=3, variant="wht_so4", t=2, H=1),
        dict(d=512, bits=4, variant="wht_so4", t=2, H=1),  # Gemma 4's global layers at the edge layers' 4 bits
        # a quarter of the keys' coordinates on a threshold (float32 input): boundary mismatches are expected
        dict(d=128, bits=3, variant="wht_so4", t=5, dtype="f32", boundary=True),
        dict(d=128, bits=3, variant="dense", t=5, dtype="f32", boundary=True),
    ]
    if gpu:  # prefill-sized spills (IsoQuantCache.compress_chunk = 4096 tokens)
        cases += [dict(d=128, bits=3, variant="wht_so4", t=4096, H=4),
                  dict(d=128, bits=3, variant="dense", t=1000, H=4)]
    return cases


def label(c: dict) -> str:
    s = f"d={c['d']} b={c['bits']} {c['variant']} t={c['t']}"
    for k in ("B", "H"):
        if k in c:
            s += f" {k}={c[k]}"
    for k in ("nc", "view", "zero_row", "boundary"):
        if c.get(k):
            s += f" {k}"
    if c.get("dtype", "f16") != "f16":
        s += f" {c['dtype']}"
    return s


@dataclass
class Rows:
    """K or V rows as the kernel sees them: buf holds dtype values in float32; view None (buf is [B, H, T, D]),
    "slice" (buf [B, H, cap, D], rows a .. a+T: a cache buffer's slice) or "transpose" (buf [B, T, H, D]
    seen as [B, H, T, D]: the model's keys/values before the cache)."""

    buf: np.ndarray
    view: str | None = None
    a: int = 0
    T: int = 0

    def logical(self) -> np.ndarray:
        if self.view == "slice":
            return self.buf[:, :, self.a:self.a + self.T]
        if self.view == "transpose":
            return self.buf.transpose(0, 2, 1, 3)
        return self.buf

    def to_mx(self, dtype: str):
        import mlx.core as mx

        a = mx.array(self.buf).astype({"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}[dtype])  # exact
        if self.view == "slice":
            return a[:, :, self.a:self.a + self.T]
        if self.view == "transpose":
            return a.transpose(0, 2, 1, 3)
        return a

    def flat(self) -> tuple[np.ndarray, tuple, tuple]:
        """(data from the view's first element, logical shape, strides in elements)."""
        b = self.buf
        if self.view == "slice":
            B, H, cap, D = b.shape
            return b.reshape(-1)[self.a * D:], (B, H, self.T, D), (H * cap * D, cap * D, D, 1)
        if self.view == "transpose":
            B, T, H, D = b.shape
            return b.reshape(-1), (B, H, T, D), (T * H * D, D, H * D, 1)
        B, H, T, D = b.shape
        return b.reshape(-1), b.shape, (H * T * D, T * D, D, 1)


def build(rng, c: dict):
    """Inputs of one case: rotation, levels, K and V Rows (fresh random rows, rotation seed and layer)."""
    import mlx.core as mx

    from rq_core.codec.codebook import get_codebook
    from rq_core.codec.rotation import Rotation

    d, bits, t = c["d"], c["bits"], c["t"]
    B, H = c.get("B", 1), c.get("H", 2)
    dtype = c.get("dtype", "f16")
    rot = Rotation(d, H, variant=c["variant"], seed=int(rng.integers(1 << 30)), layer=int(rng.integers(64)))
    levels = mx.array(get_codebook("sphere", bits, d).levels.astype("float32"))
    shape = (B, H, t, d)
    if c.get("view"):  # K: a slice [3, 3 + t) of a cache-like buffer; V: a transposed [B, t, H, d] array
        kbuf = make_rows(rng, (B, H, t + 7, d), dtype, False)
        kbuf[:, :, 3:3 + t] = make_rows(rng, shape, dtype, c.get("zero_row", False))
        vbuf = make_rows(rng, (B, t, H, d), dtype, False)
        return rot, levels, Rows(kbuf, "slice", 3, t), Rows(vbuf, "transpose")
    k = make_rows(rng, shape, dtype, c.get("zero_row", False))
    v = make_rows(rng, shape, dtype, False)
    if c.get("boundary"):
        k = boundary_rows(rng, shape, rot, np.array(levels))
    return rot, levels, Rows(k), Rows(v)


def boundary_rows(rng, shape, rot, levels: np.ndarray, frac: float = 0.25) -> np.ndarray:
    """float32 rows whose float64 z = √d·R·x/‖x‖ puts `frac` of the coordinates on a codebook threshold
    (up to the rounding of x to float32): where float32 paths may legitimately disagree."""
    from kernel_emu import attn_reference as KC

    import rq_core.kernels.launch as K

    B, H, T, d = shape
    thr = ((levels[1:] + levels[:-1]) / 2).astype(np.float64)
    z = rng.standard_normal(shape)
    on = rng.random(shape) < frac
    z[on] = rng.choice(thr, size=int(on.sum()))
    fixed = (np.where(on, z, 0.0) ** 2).sum(-1, keepdims=True)
    free = (np.where(on, 0.0, z) ** 2).sum(-1, keepdims=True)
    z = np.where(on, z, z * np.sqrt(np.maximum(d - fixed, 1e-3) / np.maximum(free, 1e-12)))  # ||z||^2 = d
    r, mats = K.rotation_args(rot)
    m = None if mats is None else np.array(mats).astype(np.float64)
    u = KC.rotate64(z / math.sqrt(d), m, np.arange(H), r, True)
    scale = np.exp(rng.uniform(-1.0, 2.0, (B, H, T, 1)))
    return (u * scale).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# float64 reference and comparison


def reference64(x: np.ndarray, rot, levels: np.ndarray):
    """z = √d·R·x/‖x‖ and n = ‖x‖ in float64, with the rotation's float32 parameters (what both paths use)."""
    from kernel_emu import attn_reference as KC

    import rq_core.kernels.launch as K

    d = x.shape[-1]
    x = x.astype(np.float64)
    n = np.sqrt((x * x).sum(-1))
    u = x / np.where(n > 0, n, 1.0)[..., None]
    r, mats = K.rotation_args(rot)
    m = None if mats is None else np.array(mats).astype(np.float64)
    z = KC.rotate64(u, m, np.arange(x.shape[1]), r, False) * math.sqrt(d)
    thr = ((levels[1:] + levels[:-1]) / 2).astype(np.float64)
    return z, n, thr


def _code_diff(idx, ref_idx, z, thr, tol, idx64=None):
    """Mismatches of idx against ref_idx: n, far (not explained by a threshold within tol), gap_max.
    With idx64: a far mismatch where idx equals the float64 code is the reference's own error (ref_far)."""
    bad = idx != ref_idx
    out = dict(n=int(bad.sum()), far=0, ref_far=0, gap_max=0.0)
    if out["n"]:
        gaps = np.abs(z[bad][:, None] - thr[None, :]).min(-1)
        step = np.abs(idx[bad].astype(np.int64) - ref_idx[bad].astype(np.int64))
        out["gap_max"] = float(gaps.max())
        far = (gaps >= tol) | (step > 1)
        if idx64 is not None:
            ref_wrong = far & (idx[bad] == idx64[bad])
            out["ref_far"] = int(ref_wrong.sum())
            far &= ~ref_wrong
        out["far"] = int(far.sum())
    return out


def _f16_ulp(x: np.ndarray) -> np.ndarray:
    return np.spacing(np.abs(x).astype(np.float16)).astype(np.float64)


def compare(got: dict, ops: dict, x: np.ndarray, rot, levels: np.ndarray, bits: int, nc: bool,
            tol: float | None = None) -> dict:
    """got/ops: {'codes', 'norms'} for one of K or V (numpy); x: the rows (float32 holding dtype values)."""
    from rq_core.codec.packing import unpack_np

    tol = TOL if tol is None else tol
    d = x.shape[-1]
    z, n64, thr = reference64(x, rot, levels)
    idx = unpack_np(got["codes"], bits, d)
    ref_idx = unpack_np(ops["codes"], bits, d)
    idx64 = (z[..., None] > thr).sum(-1)
    res = dict(values=int(idx.size), words_equal=float((got["codes"] == ops["codes"]).mean()))
    res["ops"] = _code_diff(idx, ref_idx, z, thr, tol, idx64)
    res["f64"] = _code_diff(idx, idx64, z, thr, tol)
    # a zero row has z = 0 exactly on every path (u = 0): its codes must match, even on a threshold at 0
    zero = np.broadcast_to((n64 == 0)[..., None], idx.shape)
    res["ops"]["far"] += int((zero & (idx != ref_idx)).sum())
    res["f64"]["far"] += int((zero & (idx != idx64)).sum())
    # norms: against quantize_kv's float16, and against float64 (n, or n / ||levels[idx]/√d|| with the
    # kernel's own codes, so a boundary code does not count twice)
    kn = got["norms"].astype(np.float64)
    on = ops["norms"].astype(np.float64)
    m64 = n64
    if nc:
        c_norm = np.sqrt((levels.astype(np.float64)[idx] ** 2).sum(-1)) / math.sqrt(d)
        m64 = n64 / np.maximum(c_norm, 1e-12)
    res["norm_nonfinite"] = int((~np.isfinite(kn)).sum())
    ulp = _f16_ulp(on)
    res["norm_unequal"] = int((kn != on).sum())
    res["norm_ulp_max"] = float(np.nan_to_num(np.abs(kn - on) / ulp, nan=1e9).max())
    res["norm_f64_ulp_max"] = float(np.nan_to_num(np.abs(kn - m64) / _f16_ulp(m64), nan=1e9).max())
    res["ok"] = (res["ops"]["far"] == 0 and res["f64"]["far"] == 0 and res["norm_nonfinite"] == 0
                 and res["norm_ulp_max"] <= 1.0 and res["norm_f64_ulp_max"] <= 0.51)
    return res


# ---------------------------------------------------------------------------------------------
# running the kernel: on the GPU, or its CUDA rendering on the CPU executor


def run_gpu(k_mx, v_mx, rot, levels, bits, nc):
    import mlx.core as mx

    import rq_core.kernels.launch as K

    from rq_core.kernels import config as env

    with env.override(poison=True):
        out = K.kv_append_codes(k_mx, v_mx, rot, levels, bits, norm_correction=nc)
        mx.eval(*out)
    return [np.array(a) for a in out]


def run_emu(kin: Rows, vin: Rows, dtype, rot, levels, bits, nc, seed=0, backend="cuda"):
    from kernel_emu import emulate as EK

    import rq_core.kernels.launch as K

    r, mats = K.rotation_args(rot)
    mats = np.zeros(1, np.float32) if mats is None else np.array(mats)
    (kd, shape, kst), (vd, _, vst) = kin.flat(), vin.flat()

    def enc(x):
        if dtype == "f16":
            return x.astype(np.float16)
        if dtype == "bf16":
            return ((x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), "bf16")
        return x.astype(np.float32)

    o = EK.run_kv_append(enc(kd), enc(vd), mats, np.array(K._append_consts(levels, shape[-1])), shape=shape,
                         bits=bits, rot=r, nc=nc, tk=dtype, views={"keys": (shape, kst), "values": (shape, vst)},
                         seed=seed, backend=backend)
    return [o["k_codes"], o["k_norms"], o["v_codes"], o["v_norms"]]


def check_case(rng, c: dict, mode: str) -> dict:
    """One case: kernel (mode 'gpu', or 'emu' / 'emu-metal': the CUDA / Metal rendering on the CPU executor) against
    quantize_kv and float64, for K and for V."""
    import mlx.core as mx

    from rq_core.cache.kv_cache import quantize_kv

    rot, levels, kin, vin = build(rng, c)
    dtype, bits, nc = c.get("dtype", "f16"), c["bits"], bool(c.get("nc"))
    k_mx, v_mx = kin.to_mx(dtype), vin.to_mx(dtype)
    ops = [np.array(a) for a in (*quantize_kv(k_mx, rot, levels, bits, norm_correction=nc),
                                 *quantize_kv(v_mx, rot, levels, bits, norm_correction=nc))]
    if mode == "gpu":
        got = run_gpu(k_mx, v_mx, rot, levels, bits, nc)
    else:
        got = run_emu(kin, vin, dtype, rot, levels, bits, nc, seed=int(rng.integers(1000)),
                      backend="metal" if mode == "emu-metal" else "cuda")
    k_np, v_np = kin.logical(), vin.logical()
    lv = np.array(levels)
    res = {}
    for name, x, g, o in (("K", k_np, got[:2], ops[:2]), ("V", v_np, got[2:], ops[2:])):
        if g[0].shape != o[0].shape or g[1].shape != o[1].shape:
            res[name] = dict(ok=False, error=f"shapes {g[0].shape}/{g[1].shape} vs {o[0].shape}/{o[1].shape}")
            continue
        res[name] = compare(dict(codes=g[0], norms=g[1]), dict(codes=o[0], norms=o[1]), x, rot, lv, bits, nc)
    return res


def summarize(res: dict) -> dict:
    """K and V together: values, boundary mismatches (vs ops / vs f64), far mismatches, norms unequal."""
    s = dict(values=0, ops_boundary=0, ops_far=0, ops_ref_wrong=0, f64_boundary=0, f64_far=0, gap_max=0.0,
             norm_unequal=0, norm_ulp_max=0.0, norm_f64_ulp_max=0.0, ok=True)
    for r in res.values():
        if "error" in r:
            s["ok"] = False
            s["error"] = r["error"]
            continue
        s["values"] += r["values"]
        for src in ("ops", "f64"):
            s[f"{src}_boundary"] += r[src]["n"] - r[src]["far"] - r[src]["ref_far"]
            s[f"{src}_far"] += r[src]["far"]
            s["gap_max"] = max(s["gap_max"], r[src]["gap_max"])
        s["ops_ref_wrong"] += r["ops"]["ref_far"]  # quantize_kv off float64 beyond tol, the kernel on it
        s["norm_unequal"] += r["norm_unequal"]
        s["norm_ulp_max"] = max(s["norm_ulp_max"], r["norm_ulp_max"])
        s["norm_f64_ulp_max"] = max(s["norm_f64_ulp_max"], r["norm_f64_ulp_max"])
        s["ok"] &= r["ok"]
    return s
