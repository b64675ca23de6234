"""Paired study of KV-cache settings on the bundled model: ΔPPL and KL against fp16 on the same tokens, with standard
errors, for settings the cache has and for ones it does not (emulated here): norm correction, an fp16 window,
codebooks, keys and values at their own widths, one layer in fp16, the first tokens ("sinks") in fp16, keys/values
mean-centered before quantizing, random signs before the WHT, 2-D codebooks, a residual sketch for the keys.

    python3 tools/kv_study.py [--windows 8] [--context 1024] [--only NAME,...] [--out FILE]
    python3 tools/kv_study.py --render FILE     # the table of an earlier results file

Every setting is scored on the SAME tokens as the fp16 reference (the decode-scored half of each window, exactly as
`rq eval ppl` does), so ΔNLL is a mean of per-token differences d_i = nll_i(setting) - nll_i(fp16) and its standard
error is paired. Tokens of one window are correlated, so the SE is taken over windows (cluster SE: std of the
window means of d / sqrt(windows)); the naive per-token SE is stored too. ΔPPL = exp(mean d) - 1.

Settings the cache does not support per layer or per K/V (4-bit keys with 3-bit values; one layer in fp16) are
built here: `LayerOverride` replaces chosen layers' caches, and `SplitBitsCache` stores keys and values at their own
bit widths by quantize → dequantize (docs/FORMAT.md reconstruction) and attends densely. That is the same
attention as the packed path up to float rounding (checked in tests/test_kv_study.py against IsoQuantCache at
3/3 bits), so it measures quality, not speed. `StudyCache` (same emulation) adds fp16 sink tokens and K/V
mean-centering (mu fixed at end_prefill from the prompt; exact for attention, only the quantization error changes).

Writes kv-study.json in the current directory unless --out (rows already there for the same windows and model are
kept: a run can be resumed).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's QR (turbo3's dense rotation) thrashes otherwise

import argparse
import functools
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rq_core.tools import eval as ev  # noqa: E402
from rq_core.cache.kv_cache import FP16Cache, IsoQuantCache, KVSettings, dequantize_kv  # noqa: E402


# ------------------------------------------------------------------------------------------ caches
class SplitBitsCache(IsoQuantCache):
    """IsoQuant cache with separate key/value bit widths, kept as dequantized float (study only).

    Same life cycle as IsoQuantCache: the prompt attends to itself in full precision, `end_prefill()`
    compresses it, decode steps compress their keys/values before attending (fp16_window newest kept)."""

    def __init__(self, *, key_bits: int, value_bits: int, **kw: Any) -> None:
        from rq_core.codec.codebook import get_codebook

        super().__init__(bits=value_bits, **kw)
        self.key_bits, self.value_bits = key_bits, value_bits
        cb = kw.get("codebook", "sphere")
        self.k_levels = mx.array(get_codebook(cb, key_bits, self.head_dim).levels.astype("float32"))
        self.v_levels = self.levels
        self._dk: mx.array | None = None  # dequantized packed part [B, H, T, d] float32
        self._dv: mx.array | None = None

    def _qdq(self, x: mx.array, levels: mx.array, bits: int) -> mx.array:
        from rq_core.cache.kv_cache import quantize_kv

        codes, norms = quantize_kv(x, self.rotation, levels, bits, norm_correction=self.norm_correction)
        return dequantize_kv(codes, norms, self.rotation, levels, bits, self.head_dim)

    def _qdq_k(self, x: mx.array) -> mx.array:
        return self._qdq(x, self.k_levels, self.key_bits)

    def _qdq_v(self, x: mx.array) -> mx.array:
        return self._qdq(x, self.v_levels, self.value_bits)

    def _spill(self, keep: int) -> None:
        n = self.fp16_len - keep
        if n <= 0:
            return
        dk = self._qdq_k(self._fk[:, :, :n])
        dv = self._qdq_v(self._fv[:, :, :n])
        self._dk = dk if self._dk is None else mx.concatenate([self._dk, dk], axis=2)
        self._dv = dv if self._dv is None else mx.concatenate([self._dv, dv], axis=2)
        self.packed_len += n
        rest_k, rest_v = self._fk[:, :, n : self.fp16_len], self._fv[:, :, n : self.fp16_len]
        self._fk = mx.concatenate([rest_k, mx.zeros_like(self._fk[:, :, : self._fk.shape[2] - keep])], axis=2)
        self._fv = mx.concatenate([rest_v, mx.zeros_like(self._fv[:, :, : self._fv.shape[2] - keep])], axis=2)
        self.fp16_len = keep
        mx.eval(self._dk, self._dv, self._fk, self._fv)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask=None) -> mx.array:
        L = queries.shape[2]
        self._append_fp16(keys, values)
        if not self.prefilling:
            self._spill(self.fp16_window)
        fk, fv = self._fk[:, :, : self.fp16_len], self._fv[:, :, : self.fp16_len]
        if self.packed_len:
            k = mx.concatenate([self._dk.astype(fk.dtype), fk], axis=2)
            v = mx.concatenate([self._dv.astype(fv.dtype), fv], axis=2)
        else:
            k, v = fk, fv
        m = None if (isinstance(mask, str) and L == 1) else mask
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=m)

    @property
    def nbytes(self) -> int:  # what the packed layout would hold
        if self._fk is None:
            return 0
        B, H = self._fk.shape[:2]
        return B * H * (self.packed_len * packed_bytes(self.key_bits, self.value_bits, self.head_dim)
                        + self.fp16_len * 2 * self.head_dim * 2)


class QJLKeysCache(SplitBitsCache):
    """Keys as TurboQuant's inner-product quantizer (study only): (key_bits - 1)-bit IsoQuant codes, then one bit per
    coordinate of a Gaussian sketch S of the residual r (QJL) and |r| in float16. For any query q,
    <q, k_mse> + sqrt(pi/2) |r| / d <S q, sign(S r)> is an unbiased estimate of <q, k>; it equals <q, k~> for
    k~ = k_mse + sqrt(pi/2) |r| / d S^T sign(S r), so this cache stores k~ and attends as the others do. Bytes: the
    key's bits as IsoQuant at key_bits, plus one more float16 norm a key."""

    def __init__(self, **kw: Any) -> None:
        from rq_core.codec.codebook import get_codebook

        super().__init__(**kw)
        d, h = int(kw["head_dim"]), int(kw["n_kv_heads"])
        cb = kw.get("codebook", "sphere")
        self.k_levels = mx.array(get_codebook(cb, self.key_bits - 1, d).levels.astype("float32"))
        rng = np.random.default_rng([int(kw.get("seed", 0)), int(kw.get("layer", 0)), 0x0A1])
        self._S = mx.array(rng.standard_normal((h, d, d)).astype(np.float32))  # a sketch per kv head

    def _qdq_k(self, x: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        k_mse = self._qdq(x, self.k_levels, self.key_bits - 1)
        r = x - k_mse
        rn = mx.sqrt((r * r).sum(axis=-1, keepdims=True)).astype(mx.float16).astype(mx.float32)
        S = self._S[None]  # [1, H, d, d]
        sgn = mx.where(r @ S.transpose(0, 1, 3, 2) >= 0, 1.0, -1.0)  # sign(S r) per token: [B, H, T, d]
        d = x.shape[-1]
        return k_mse + (math.sqrt(math.pi / 2) / d) * rn * (sgn @ S)

    @property
    def nbytes(self) -> int:
        if self._fk is None:
            return 0
        B, H = self._fk.shape[:2]
        return super().nbytes + B * H * self.packed_len * 2


@functools.lru_cache(maxsize=None)
def pair_codebook(bits: int, d: int, seed: int = 0, iters: int = 30) -> np.ndarray:
    """A 2^(2 bits)-point codebook for pairs of rotated coordinates (z = sqrt(d) R u of unit vectors u): Lloyd's
    algorithm on pairs drawn from the sphere's marginal, started from the scalar codebook's product grid. At 3 bits,
    d = 128: 0.0295 squared error a coordinate against the scalar codebook's 0.0340."""
    from rq_core.codec.codebook import get_codebook

    rng = np.random.default_rng(seed)
    u = rng.standard_normal((4096, d))
    z = (u / np.linalg.norm(u, axis=1, keepdims=True) * math.sqrt(d)).reshape(-1, 2)
    lv = get_codebook("sphere", bits, d).levels.astype(np.float64)
    c = np.array([[a, b] for a in lv for b in lv])
    for _ in range(iters):
        a = ((z[:, None, :] - c[None]) ** 2).sum(-1).argmin(1)
        for k in range(len(c)):
            if (a == k).any():
                c[k] = z[a == k].mean(0)
    return c.astype(np.float32)


class PairVQKeysCache(SplitBitsCache):
    """Keys with a 2-D codebook (study only): each pair of rotated coordinates (2j, 2j + 1) takes the nearest of
    2^(2 key_bits) points (pair_codebook) instead of two scalar levels, at the same bits. The GPU kernels decode keys
    through a pair table already (an entry a 2 x key_bits-bit field), so this would cost them nothing but the table's
    contents. Norms as the cache's (no norm correction)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._C = mx.array(pair_codebook(self.key_bits, int(kw["head_dim"])))  # [P, 2]

    def _qdq_k(self, x: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        d = x.shape[-1]
        n = mx.linalg.norm(x, axis=-1, keepdims=True)
        z = self.rotation.forward(x / mx.where(n > 0, n, 1.0)) * math.sqrt(d)
        p = z.reshape(*z.shape[:-1], d // 2, 1, 2)
        idx = ((p - self._C) ** 2).sum(-1).argmin(-1)  # [.., d/2]
        zq = self._C[idx].reshape(z.shape)
        n16 = n.astype(mx.float16).astype(mx.float32)
        return self.rotation.inverse(zq / math.sqrt(d)) * n16


@functools.lru_cache(maxsize=None)
def pair_codebook_points(n: int, d: int, seed: int = 0, iters: int = 40) -> np.ndarray:
    """An n-point codebook for pairs of rotated coordinates (log2(n) / 2 bits a coordinate: 128 points are 3.5 bits,
    32 are 2.5): Lloyd's algorithm on pairs drawn from the sphere's marginal (rq_core.codec.codebook, whose `pair_codebook`
    the cache's kv.pair_points use: seed 1 for keys, 2 for values, as here)."""
    from rq_core.codec.codebook import _pair_lloyd

    return _pair_lloyd(n, d, seed, iters)


class PairVQCache(SplitBitsCache):
    """Keys and values each with a 2-D codebook of its own size (study only): pair points (PK, PV) give
    log2(PK) / 2 and log2(PV) / 2 bits a coordinate. (128, 32) moves half a bit a coordinate from values to keys at
    IsoQuant-3's bytes (7 + 5 bits a pair of coordinates, against 6 + 6)."""

    def __init__(self, *, pair_points: tuple[int, int], **kw: Any) -> None:
        super().__init__(**kw)
        d = int(kw["head_dim"])
        self._CK = mx.array(pair_codebook_points(int(pair_points[0]), d, seed=1))
        self._CV = mx.array(pair_codebook_points(int(pair_points[1]), d, seed=2))

    def _pq(self, x: mx.array, C: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        d = x.shape[-1]
        n = mx.linalg.norm(x, axis=-1, keepdims=True)
        z = self.rotation.forward(x / mx.where(n > 0, n, 1.0)) * math.sqrt(d)
        p = z.reshape(*z.shape[:-1], d // 2, 1, 2)
        zq = C[((p - C) ** 2).sum(-1).argmin(-1)].reshape(z.shape)
        return self.rotation.inverse(zq / math.sqrt(d)) * n.astype(mx.float16).astype(mx.float32)

    def _qdq_k(self, x: mx.array) -> mx.array:
        return self._pq(x, self._CK)

    def _qdq_v(self, x: mx.array) -> mx.array:
        return self._pq(x, self._CV)


class StudyCache(SplitBitsCache):
    """SplitBitsCache plus two cheap, exact-or-free changes (study only; rq_core is unchanged):

    - `sink`: the first `sink` tokens of the sequence stay fp16 for good (attention-sink tokens), on top of the
      `fp16_window` newest ones. Tokens become sinks as they leave the prompt/decode fp16 segment, oldest first.
    - `center` "k" / "kv": at end_prefill, mu = mean of the prompt's keys (values) per batch row and kv head; every
      key (value) is quantized as x - mu. Softmax is invariant to one vector subtracted from all keys, and the
      attention weights sum to 1, so adding mu back after dequantization (what this does) is the same attention as
      a cache that stores centered keys and adds mu_v to the output; only the quantization error changes.
    """

    def __init__(self, *, sink: int = 0, center: str = "", signs: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        if sink < 0 or center not in ("", "k", "kv"):
            raise ValueError(f"sink {sink} must be >= 0 and center one of '', 'k', 'kv' (got {center!r})")
        self.sink, self.center = int(sink), center
        # signs: random ±1 per (kv head, dim) before the rotation, R' = R ∘ D (a randomized Hadamard, as QuaRot's);
        # D is orthogonal, so quantizing D x and multiplying back by D after dequantization is exactly the cache
        # with rotation R ∘ D (the query needs no change here: this cache attends over dequantized keys)
        self._signs: mx.array | None = None
        if signs:
            rng = np.random.default_rng([int(kw.get("seed", 0)), int(kw.get("layer", 0)), 0x5195])
            d, h = int(kw["head_dim"]), int(kw["n_kv_heads"])
            self._signs = mx.array(np.where(rng.random((1, h, 1, d)) < 0.5, -1.0, 1.0).astype(np.float32))
        self.sink_len = 0
        self._sk: mx.array | None = None  # [B, H, sink_len, d], model dtype
        self._sv: mx.array | None = None
        self._mk: mx.array | None = None  # centering vectors [B, H, 1, d] float32
        self._mv: mx.array | None = None

    @property
    def offset(self) -> int:
        return self.sink_len + self.packed_len + self.fp16_len

    def _qdq(self, x: mx.array, levels: mx.array, bits: int) -> mx.array:
        if self._signs is None:
            return super()._qdq(x, levels, bits)
        return super()._qdq(x.astype(mx.float32) * self._signs, levels, bits) * self._signs

    def _qdq_k(self, x: mx.array) -> mx.array:
        if self._mk is None:
            return super()._qdq_k(x)
        return super()._qdq_k(x.astype(mx.float32) - self._mk) + self._mk

    def _qdq_v(self, x: mx.array) -> mx.array:
        if self._mv is None:
            return super()._qdq_v(x)
        return super()._qdq_v(x.astype(mx.float32) - self._mv) + self._mv

    def _take_sinks(self) -> None:
        """Move the oldest fp16-segment tokens into the sink until it holds `sink` tokens (before any spill,
        so only the sequence's first tokens can be sinks)."""
        s = min(self.sink - self.sink_len, self.fp16_len)
        if s <= 0 or self.packed_len:
            return
        sk, sv = self._fk[:, :, :s], self._fv[:, :, :s]
        self._sk = sk if self._sk is None else mx.concatenate([self._sk, sk], axis=2)
        self._sv = sv if self._sv is None else mx.concatenate([self._sv, sv], axis=2)
        self._fk, self._fv = self._fk[:, :, s:], self._fv[:, :, s:]
        self.fp16_len -= s
        self.sink_len += s
        mx.eval(self._sk, self._sv, self._fk, self._fv)

    def end_prefill(self) -> None:
        self.prefilling = False
        n = self.fp16_len
        if self.center and n:
            self._mk = self._fk[:, :, :n].astype(mx.float32).mean(axis=2, keepdims=True)
            if self.center == "kv":
                self._mv = self._fv[:, :, :n].astype(mx.float32).mean(axis=2, keepdims=True)
        self._take_sinks()
        self._spill(self.fp16_window)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask=None) -> mx.array:
        L = queries.shape[2]
        self._append_fp16(keys, values)
        if not self.prefilling:
            self._take_sinks()
            self._spill(self.fp16_window)
        fk, fv = self._fk[:, :, : self.fp16_len], self._fv[:, :, : self.fp16_len]
        ks, vs = [], []
        if self.sink_len:
            ks.append(self._sk), vs.append(self._sv)
        if self.packed_len:
            ks.append(self._dk.astype(fk.dtype)), vs.append(self._dv.astype(fv.dtype))
        ks.append(fk), vs.append(fv)
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)  # positions in order: sink, packed, window
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        m = None if (isinstance(mask, str) and L == 1) else mask
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=m)

    @property
    def nbytes(self) -> int:
        if self._fk is None:
            return 0
        B, H = self._fk.shape[:2]
        mu = (self._mk is not None) + (self._mv is not None)
        return super().nbytes + B * H * (self.sink_len * 2 * self.head_dim * 2 + mu * self.head_dim * 2)


def packed_bytes(key_bits: int, value_bits: int, d: int) -> int:
    """Bytes per token per kv head of the packed layout: uint32 code words + a float16 norm, for K and V."""
    return sum(4 * ((d * b + 31) // 32) + 2 for b in (key_bits, value_bits))


@dataclass
class Setting:
    name: str
    kv: KVSettings
    key_bits: Optional[int] = None  # None: kv.bits (the real cache); else SplitBitsCache
    value_bits: Optional[int] = None
    fp16_layers: tuple = ()  # layers whose cache is a plain FP16Cache
    note: str = ""
    sink: int = 0  # first tokens kept fp16 (StudyCache)
    center: str = ""  # "k" | "kv": mean-centering before quantization (StudyCache)
    signs: bool = False  # random ±1 per dim before the rotation (StudyCache)
    qjl: bool = False  # keys: (key_bits - 1)-bit codes + a 1-bit sketch of the residual (QJLKeysCache)
    pairvq: bool = False  # keys: a 2-D codebook a pair of coordinates (PairVQKeysCache)
    pair_points: tuple = ()  # (keys', values') points of 2-D codebooks (PairVQCache)

    @property
    def emulated(self) -> bool:
        return (self.key_bits is not None or bool(self.sink) or bool(self.center) or self.signs or self.qjl
                or self.pairvq or bool(self.pair_points))

    def make_cache(self, model: Any) -> list:
        caches = model.make_cache(self.kv)
        for i, c in enumerate(caches):
            if i in self.fp16_layers:
                caches[i] = FP16Cache()
            elif self.emulated and isinstance(c, IsoQuantCache):
                kw = dict(key_bits=self.key_bits or self.kv.bits, value_bits=self.value_bits or self.kv.bits,
                          head_dim=c.head_dim, n_kv_heads=c.n_kv_heads, layer=i, rotation=c.rotation.variant,
                          codebook=self.kv.codebook, fp16_window=self.kv.fp16_window,
                          norm_correction=self.kv.norm_correction, seed=self.kv.seed)
                caches[i] = (StudyCache(sink=self.sink, center=self.center, signs=self.signs, **kw)
                             if self.sink or self.center or self.signs
                             else QJLKeysCache(**kw) if self.qjl else PairVQKeysCache(**kw) if self.pairvq
                             else PairVQCache(pair_points=self.pair_points, **kw) if self.pair_points
                             else SplitBitsCache(**kw))
        return caches

    def bytes_ratio(self, n_layers: int, d: int, tokens: int) -> float:
        """KV bytes / fp16 bytes for a cache holding `tokens` tokens (all layers are full attention here)."""
        if self.kv.mode == "fp16":
            return 1.0
        kb = self.key_bits or self.kv.bits
        vb = self.value_bits or self.kv.bits
        win = min(self.kv.fp16_window + self.sink, tokens)  # fp16 tokens: sinks + newest window
        per_layer = (tokens - win) * packed_bytes(kb, vb, d) + win * 4 * d + len(self.center) * 2 * d  # + mu
        fp16 = tokens * 4 * d
        total = sum(fp16 if i in self.fp16_layers else per_layer for i in range(n_layers))
        return total / (n_layers * fp16)


class _CacheModel:
    """The model with make_cache replaced by a Setting's (so ev.window_logprobs builds the study's caches)."""

    def __init__(self, model: Any, setting: Setting) -> None:
        self._m, self._s = model, setting

    def make_cache(self, kv: KVSettings) -> list:
        return self._s.make_cache(self._m)

    def __call__(self, *a, **k):
        return self._m(*a, **k)


def token_logprobs(model: Any, wins: list, setting: Setting, *, prefill: int, step: int,
                   ref_full: Optional[list] = None) -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
    """Per window: target log-probs [n_scored] (stacked [W, n]), KL(ref ‖ setting) per token [W, n], full log-probs
    (only for the fp16 reference, else empty) and whether the setting's top token is the reference's [W, n] (empty for
    the reference)."""
    m = _CacheModel(model, setting)
    lps, kls, fulls, top1 = [], [], [], []
    for wi, w in enumerate(wins):
        lp = ev.window_logprobs(m, w, setting.kv, prefill=prefill, step=step)
        tgt = mx.array(w[prefill + 1 :].astype(np.int32))[:, None]
        lps.append(np.array(mx.take_along_axis(lp, tgt, axis=-1)[:, 0]))
        if ref_full is None:
            fulls.append(lp)
        else:
            lr = ref_full[wi]
            kls.append(np.array((mx.exp(lr) * (lr - lp)).sum(axis=-1)))
            top1.append(np.array(mx.argmax(lr, axis=-1) == mx.argmax(lp, axis=-1)))
    return np.stack(lps), (np.stack(kls) if kls else np.zeros(0)), fulls, (np.stack(top1) if top1 else np.zeros(0))


def paired_stats(d: np.ndarray) -> dict:
    """d [W, n]: per-token differences of NLL (setting - reference). Mean, cluster (window) SE, naive SE."""
    W, n = d.shape
    wm = d.mean(axis=1)
    mean = float(d.mean())
    se_cluster = float(wm.std(ddof=1) / math.sqrt(W)) if W > 1 else float("nan")
    se_token = float(d.std(ddof=1) / math.sqrt(d.size))
    return {"d_nll": mean, "se": se_cluster, "se_token": se_token,
            "rel_dppl": math.expm1(mean), "rel_dppl_lo": math.expm1(mean - 1.96 * se_cluster),
            "rel_dppl_hi": math.expm1(mean + 1.96 * se_cluster)}


# ----------------------------------------------------------------------------------------- settings
def iso(**kw: Any) -> KVSettings:
    """IsoQuant-3 with scalar codebooks (the study's baseline; the cache's default is the pair codebooks of the
    PP128x32 rows)."""
    return KVSettings(mode="isoquant3", **{"pair_points": ()} | kw)


def turbo(**kw: Any) -> KVSettings:
    return KVSettings(mode="turbo3", **kw)


def all_settings(n_layers: int) -> list[Setting]:
    last = n_layers - 1
    S = [  # in priority order (a partial run keeps the most informative rows)
        Setting("turbo3 s0", turbo(seed=0)),
        Setting("wht_so4 s0", iso(seed=0)),
        Setting("turbo3 s1", turbo(seed=1)),
        Setting("wht_so4 s1", iso(seed=1)),
        Setting("wht_so4 K4V3 s0", iso(), key_bits=4, value_bits=3),
        Setting("wht_so4 norm_corr s0", iso(norm_correction=True)),
        Setting("wht_so4 win32 s0", iso(fp16_window=32)),
        Setting("turbo3 win32 s0", turbo(fp16_window=32)),
        Setting("wht_so4 win32 s1", iso(fp16_window=32, seed=1)),
        Setting("wht_so4 gaussian s0", iso(codebook="gaussian")),
        Setting("wht_so4 L0-fp16 s0", iso(), fp16_layers=(0,)),
        Setting(f"wht_so4 L{last}-fp16 s0", iso(), fp16_layers=(last,)),
        Setting("wht_so4 K3V4 s0", iso(), key_bits=3, value_bits=4),
        Setting("turbo3 s2", turbo(seed=2)),
        Setting("wht_so4 s2", iso(seed=2)),
        Setting("turbo3 K4V3 s0", turbo(), key_bits=4, value_bits=3),
        Setting("wht_so4 win128 s0", iso(fp16_window=128)),
        Setting("wht_so4 norm_corr s1", iso(norm_correction=True, seed=1)),
        Setting("wht_so4 K4V3 s1", iso(seed=1), key_bits=4, value_bits=3),
        Setting("wht_so4 K3V3-emul s0", iso(), key_bits=3, value_bits=3, note="emulation check"),
        # cheap exact-or-nearly-free changes: smaller windows, sink tokens, mean-centering
        Setting("wht_so4 win16 s0", iso(fp16_window=16)),
        Setting("wht_so4 win8 s0", iso(fp16_window=8)),
        Setting("wht_so4 kcenter s0", iso(), center="k"),
        Setting("wht_so4 kvcenter s0", iso(), center="kv"),
        Setting("wht_so4 sink4 s0", iso(), sink=4),
        Setting("wht_so4 sink1 s0", iso(), sink=1),
        Setting("wht_so4 sink4+win16 s0", iso(fp16_window=16), sink=4),
        Setting("wht_so4 kvcenter+win16 s0", iso(fp16_window=16), center="kv"),
        Setting("wht_so4 kvcenter+sink4 s0", iso(), center="kv", sink=4),
    ]
    for seed in (1, 2):  # seed repeats of the new settings (run with --only)
        S += [Setting(f"wht_so4 win32 s{seed}", iso(fp16_window=32, seed=seed)) if seed == 2 else None,
              Setting(f"wht_so4 win16 s{seed}", iso(fp16_window=16, seed=seed)),
              Setting(f"wht_so4 win8 s{seed}", iso(fp16_window=8, seed=seed)),
              Setting(f"wht_so4 kcenter s{seed}", iso(seed=seed), center="k"),
              Setting(f"wht_so4 kvcenter s{seed}", iso(seed=seed), center="kv"),
              Setting(f"wht_so4 sink4 s{seed}", iso(seed=seed), sink=4),
              Setting(f"wht_so4 sink4+win16 s{seed}", iso(fp16_window=16, seed=seed), sink=4),
              Setting(f"wht_so4 kvcenter+win16 s{seed}", iso(fp16_window=16, seed=seed), center="kv"),
              Setting(f"turbo3 win32 s{seed}", turbo(fp16_window=32, seed=seed))]
    for seed in range(6):  # random signs before the WHT (a randomized Hadamard), with the default window
        S.append(Setting(f"wht_so4 signs win32 s{seed}", iso(fp16_window=32, seed=seed), signs=True))
    for seed in range(6):  # the same through the real cache: the rwht_so4 rotation (rq_core.codec.rotation)
        S.append(Setting(f"rwht_so4 win32 s{seed}", iso(rotation="rwht_so4", fp16_window=32, seed=seed)))
    for seed in (3, 4, 5):  # more rotation draws of the two default configurations
        S += [Setting(f"wht_so4 win32 s{seed}", iso(fp16_window=32, seed=seed)),
              Setting(f"turbo3 win32 s{seed}", turbo(fp16_window=32, seed=seed))]
    for seed in range(3):  # keys at 4 bits, values at 2: the same bytes as IsoQuant-3
        S.append(Setting(f"wht_so4 K4V2 win32 s{seed}", iso(fp16_window=32, seed=seed), key_bits=4, value_bits=2))
        S.append(Setting(f"wht_so4 K4V3 win32 s{seed}", iso(fp16_window=32, seed=seed), key_bits=4, value_bits=3))
    for seed in range(3):  # keys with a 2-D codebook a coordinate pair, same bytes
        S.append(Setting(f"wht_so4 pairvq win32 s{seed}", iso(fp16_window=32, seed=seed), pairvq=True))
    for seed in range(3):  # keys and values with 2-D codebooks of 128 and 32 points: 3.5 + 2.5 bits
        S.append(Setting(f"wht_so4 PP128x32 win32 s{seed}", iso(fp16_window=32, seed=seed), pair_points=(128, 32)))
    for seed in (3, 4, 5):  # the same through the real cache (isoquant3's default)
        S.append(Setting(f"wht_so4 PP128x32 win32 s{seed}", iso(fp16_window=32, seed=seed, pair_points=(128, 32))))
    for seed in range(3):  # keys 256 points (4 bits a coordinate), values 16 (2): the same bytes again
        S.append(Setting(f"wht_so4 PP256x16 win32 s{seed}", iso(fp16_window=32, seed=seed, pair_points=(256, 16))))
    S = [s for s in S if s is not None]
    return S


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--step", type=int, default=32)
    ap.add_argument("--only", default="", help="comma-separated setting names (default: all)")
    ap.add_argument("--out", default="kv-study.json", help="results JSON (default %(default)s); rows already there "
                                                             "for the same windows are kept (resumable)")
    ap.add_argument("--render", metavar="JSON", default=None, help="only print the table of a results JSON")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return

    t0 = time.time()
    em = ev.load_eval_model(args.model)
    ids = ev.encode_ids(em.tokenizer, ev.load_heldout_text())
    ctx = ev.check_context(args.context, em.context)
    prefill = ctx // 2
    wins = ev.windows(ids, ctx, args.windows)
    n_layers = int(em.config["num_hidden_layers"])
    d = int(em.config.get("head_dim") or em.config["hidden_size"] // em.config["num_attention_heads"])
    now = datetime.now(timezone.utc)
    path = Path(args.out)
    tag = f"c{ctx}w{len(wins)}s{args.step}"

    ref_set = Setting("fp16", KVSettings(mode="fp16"))
    t = time.time()
    ref_lp, _, ref_full, _ = token_logprobs(em.model, wins, ref_set, prefill=prefill, step=args.step)
    print(f"fp16: ppl {math.exp(-ref_lp.mean()):.3f} on {ref_lp.size} tokens [{time.time() - t:.0f} s]", flush=True)

    # rows from an earlier run are reused only for the same windows AND the same model: the fp16
    # reference's mean log-prob identifies the weights (a retrained model must not mix with old rows)
    tag += f"r{float(ref_lp.mean()):.6f}"
    prev = json.loads(path.read_text()) if path.is_file() else {}
    same = prev.get("tag") == tag or (  # a file written before the tag carried the reference: same fp16 ppl
        prev.get("tag") == tag.split("r")[0] and abs(prev.get("ppl_fp16", 0) / math.exp(-ref_lp.mean()) - 1) < 1e-6)
    rows = {r["name"]: r for r in prev.get("rows", [])} if same else {}
    if prev and not same:
        print(f"note: {path} holds rows of other windows or another model; they are replaced", flush=True)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    known = {s.name: s for s in all_settings(n_layers)}
    if unknown := [n for n in only if n not in known]:
        raise SystemExit(f"--only: unknown settings {unknown} (known: {', '.join(known)})")
    settings = [known[n] for n in only] if only else list(known.values())  # --only runs in the given order
    for s in settings:
        t = time.time()
        lp, kl, _, top1 = token_logprobs(em.model, wins, s, prefill=prefill, step=args.step, ref_full=ref_full)
        st = paired_stats(ref_lp - lp)
        rows[s.name] = {"name": s.name, "mode": s.kv.mode, "rotation": ev.rotation_of(s.kv), "seed": s.kv.seed,
                        "bits": s.kv.bits, "key_bits": s.key_bits or s.kv.bits, "value_bits": s.value_bits or s.kv.bits,
                        "codebook": s.kv.codebook, "fp16_window": s.kv.fp16_window,
                        "norm_correction": s.kv.norm_correction, "fp16_layers": list(s.fp16_layers),
                        "emulated": s.emulated, "sink": s.sink, "center": s.center, "signs": s.signs,
                        "note": s.note,
                        "bytes_ratio": s.bytes_ratio(n_layers, d, ctx), "ppl": math.exp(-lp.mean()),
                        "mean_kl": float(kl.mean()), "top1_agreement": float(top1.mean()),
                        "seconds": round(time.time() - t, 1), **st,
                        "window_d_nll": [float(x) for x in (ref_lp - lp).mean(axis=1)],
                        "window_kl": [float(x) for x in kl.mean(axis=1)]}
        r = rows[s.name]
        print(f"{s.name:26s} ΔPPL {r['rel_dppl']:+.3%} ± {r['se']:.4f} (nll SE; token SE {r['se_token']:.4f}) "
              f"KL {r['mean_kl']:.4f} bytes {r['bytes_ratio']:.3f} [{r['seconds']} s]", flush=True)
        _write(path, tag, args, em, ref_lp, rows, t0, now)

    out = _write(path, tag, args, em, ref_lp, rows, t0, now)
    print(render(out))


def _write(path: Path, tag: str, args: Any, em: Any, ref_lp: np.ndarray, rows: dict, t0: float, now) -> dict:
    out = {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "tag": tag, "model": str(em.path),
           "device": str(mx.default_device()), "machine": platform.node(), "mlx": mx.__version__,
           "context": args.context, "prefill": args.context // 2, "windows": int(ref_lp.shape[0]),
           "step": args.step, "tokens": int(ref_lp.size), "ppl_fp16": math.exp(-ref_lp.mean()),
           "rows": list(rows.values()), "seconds": round(time.time() - t0, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    os.replace(tmp, path)
    return out


def pairwise(ra: dict, rb: dict) -> dict:
    """Paired difference of two settings on the same tokens: mean ΔNLL of a − b with its SE over windows
    (the mean of per-token differences is linear, so per-window means are enough)."""
    wa, wb = np.asarray(ra["window_d_nll"]), np.asarray(rb["window_d_nll"])
    diff = wa - wb
    out = {"d_nll": float(diff.mean()), "se": float(diff.std(ddof=1) / math.sqrt(diff.size))}
    if ra.get("window_kl") and rb.get("window_kl"):
        dk = np.asarray(ra["window_kl"]) - np.asarray(rb["window_kl"])
        out.update(d_kl=float(dk.mean()), se_kl=float(dk.std(ddof=1) / math.sqrt(dk.size)))
    return out


PAIRS = [("wht_so4 s0", "turbo3 s0"), ("wht_so4 s1", "turbo3 s1"), ("wht_so4 s2", "turbo3 s2"),
         ("wht_so4 norm_corr s0", "wht_so4 s0"), ("wht_so4 norm_corr s1", "wht_so4 s1"),
         ("wht_so4 gaussian s0", "wht_so4 s0"), ("wht_so4 win32 s0", "wht_so4 s0"),
         ("wht_so4 win128 s0", "wht_so4 s0"), ("wht_so4 win32 s0", "turbo3 win32 s0"),
         ("wht_so4 win32 s1", "wht_so4 s1"), ("wht_so4 win32 s0", "turbo3 s0"), ("wht_so4 win32 s1", "turbo3 s1"),
         ("turbo3 win32 s0", "turbo3 s0"), ("wht_so4 K4V3 s0", "wht_so4 s0"), ("wht_so4 K3V4 s0", "wht_so4 s0"),
         ("wht_so4 K3V3-emul s0", "wht_so4 s0"), ("wht_so4 L0-fp16 s0", "wht_so4 s0"),
         ("wht_so4 L5-fp16 s0", "wht_so4 s0"), ("wht_so4 K4V3 s0", "turbo3 K4V3 s0"),
         ("wht_so4 K4V3 s1", "wht_so4 s1"), ("wht_so4 4bit s0", "turbo3 4bit s0")]
PAIRS += [(f"wht_so4 {x} s{i}", f"wht_so4 s{i}") for i in range(3)
          for x in ("win16", "win8", "kcenter", "kvcenter", "sink4", "sink1", "sink4+win16", "kvcenter+win16",
                    "kvcenter+sink4")]
PAIRS += [(f"wht_so4 {x} s{i}", f"wht_so4 win32 s{i}") for i in range(3) for x in ("win16", "win8")]
PAIRS += [(f"wht_so4 win32 s{i}", f"turbo3 win32 s{i}") for i in (1, 2)]
PAIRS += [(f"wht_so4 pairvq win32 s{i}", f"wht_so4 win32 s{i}") for i in range(3)]
PAIRS += [(f"wht_so4 PP128x32 win32 s{i}", f"wht_so4 win32 s{i}") for i in range(3)]


def row_bytes(r: dict, n_layers: int, d: int, tokens: int) -> float:
    """KV bytes / fp16 of a results row at `tokens` tokens (the same formula as Setting.bytes_ratio)."""
    s = Setting(r["name"], KVSettings(mode=r["mode"], bits=r["bits"], fp16_window=r["fp16_window"], pair_points=()),
                key_bits=r["key_bits"], value_bits=r["value_bits"], fp16_layers=tuple(r["fp16_layers"]),
                sink=r.get("sink", 0), center=r.get("center", ""))
    return s.bytes_ratio(n_layers, d, tokens)


def render(out: dict) -> str:
    rows = out["rows"]
    cfg = json.loads((Path(out["model"]) / "config.json").read_text())
    n_layers, full = int(cfg["num_hidden_layers"]), int(cfg.get("max_position_embeddings", 2048))
    d = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    lines = [
        "## IsoQuant-3 settings study (`python3 tools/kv_study.py`)", "",
        f"Measured {out['date']} on {out['device']} (MLX {out['mlx']}), bundled model, held-out text; "
        f"{out['windows']} windows of {out['context']} tokens, first {out['prefill']} prefilled then compressed, "
        f"the rest scored in decode steps of {out['step']} (as `rq eval ppl`): **{out['tokens']:,} scored tokens**, "
        f"the same tokens for every row; fp16 PPL {out['ppl_fp16']:.3f}. ΔPPL = exp(mean per-token ΔNLL) − 1; "
        "± is 1.96 × the paired standard error over windows (per-window mean ΔNLL, so within-window correlation "
        "is counted). Rows marked *emul.* store K and V at their own bit widths by quantize→dequantize and attend "
        "densely (same math as the packed path; its 3/3-bit row checks that against the real cache); *sinkS* keeps the "
        "sequence's first S tokens fp16, *kcenter*/*kvcenter* quantize keys (and values) minus their prompt mean per "
        "layer and kv head, exact for attention (softmax is shift-invariant over keys; weights sum to 1 for values). "
        "Bytes: KV bytes / fp16 bytes of the packed layout (codes + fp16 norms; fp16 window, sinks and fp16 layers "
        "at 2 bytes; a centering mean adds d fp16 per layer and head) "
        f"at the window's {out['context']} tokens and at the model's full {full}. The seed-0 turbo3 and "
        "wht_so4 rows are exactly what `rq eval ppl --context 1024 --windows 8` measures.", "",
        f"| setting | ΔPPL | 95% CI | ΔNLL SE (window / token) | mean KL | KV bytes / fp16 @{out['context']} | @{full} |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = r["name"] + (" *emul.*" if r.get("emulated") else "")
        lines.append(f"| {name} | {r['rel_dppl']:+.2%} | [{r['rel_dppl_lo']:+.2%}, {r['rel_dppl_hi']:+.2%}] "
                     f"| {r['se']:.4f} / {r['se_token']:.4f} | {r['mean_kl']:.4f} | {r['bytes_ratio']:.3f} "
                     f"| {row_bytes(r, n_layers, d, full):.3f} |")
    by = {r["name"]: r for r in rows}
    seeds = []
    fams: dict = {}  # setting family (the name without its " s<seed>") → rows over seeds
    for r in rows:
        fam, _, sd = r["name"].rpartition(" s")
        if fam and sd.isdigit():
            fams.setdefault(fam, []).append(r)
    for fam, rs in fams.items():
        if len(rs) > 1:
            w = np.mean([r["window_d_nll"] for r in rs], axis=0)  # seed-averaged per-window ΔNLL
            m = float(w.mean())
            se = float(w.std(ddof=1) / math.sqrt(w.size))
            seeds.append(f"| {fam}, mean of {len(rs)} seeds | {math.expm1(m):+.2%} | "
                         f"[{math.expm1(m - 1.96 * se):+.2%}, {math.expm1(m + 1.96 * se):+.2%}] | {se:.4f} / - "
                         f"| {np.mean([r['mean_kl'] for r in rs]):.4f} | {rs[0]['bytes_ratio']:.3f} "
                         f"| {row_bytes(rs[0], n_layers, d, full):.3f} |")
            seeds.append(f"| ↳ seed spread ({fam}) | " + ", ".join(f"{r['rel_dppl']:+.2%}" for r in rs) + " | | | | | |")
    lines += seeds
    pairs = [(a, b, pairwise(by[a], by[b])) for a, b in PAIRS if a in by and b in by and out["windows"] > 1]
    if pairs:
        lines += ["", "Paired differences between settings (same tokens; ΔNLL of A − B, ± 1.96 SE over windows; "
                  "negative = A better; mean KL likewise where stored):", "",
                  "| A | B | ΔNLL A − B | ± 1.96 SE | Δ mean KL A − B | ± 1.96 SE |", "| --- | --- | --- | --- | --- | --- |"]
        for a, b, p in pairs:
            kl = (f"{p['d_kl']:+.4f} | {1.96 * p['se_kl']:.4f}" if "d_kl" in p
                  else f"{by[a]['mean_kl'] - by[b]['mean_kl']:+.4f} | -")
            lines.append(f"| {a} | {b} | {p['d_nll']:+.4f} | {1.96 * p['se']:.4f} | {kl} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
