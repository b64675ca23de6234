"""Reference compressed-space attention: MLX ops only, any backend, never a custom kernel (the kernels' oracle).

Because R is orthogonal, ⟨Rq, Rk⟩ = ⟨q, k⟩ and Σ α_j R v_j = R Σ α_j v_j: the caller rotates the
query once, we score keys straight from their codes, accumulate values in the rotated space, and
the caller applies Rᵀ once at the end (docs/FORMAT.md, "Compressed KV cache layout").

The context is walked in chunks with an online softmax, so the memory beyond the cache is
O(chunk·d + T): never a full-precision K or V of the context. Everything here is float32.
"""

from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx

from rq_core.codec.packing import unpack

CHUNK = 1024
# online_attention evaluates its running state after each chunk of keys when one chunk's scores exceed this: a long
# prompt's chunk attending to many compressed tokens would otherwise build every chunk's temporaries into one graph
EVAL_BYTES = 32 << 20

# (k0, k1) -> (keys [B, Hkv, C, d], key scale [B, Hkv, C] | None, values [B, Hkv, C, d], value scale | None)
ChunkFn = Callable[[int, int], tuple]


def _mask_5d(mask: mx.array, B: int, Hkv: int, G: int, L: int) -> mx.array:
    """An [.., L, T] mask broadcastable to [B, Hq, L, T] → [B|1, Hkv|1, G|1, L, T]."""
    while mask.ndim < 4:
        mask = mask[None]
    mb, mh = mask.shape[0], mask.shape[1]
    if mh == Hkv * G and mh > 1:
        return mask.reshape(mb, Hkv, G, *mask.shape[2:])
    return mask[:, :, None]


def online_attention(q: mx.array, n_kv_heads: int, T: int, chunk_fn: ChunkFn, *, scale: float,
                     q_pos0: int = 0, k_pos0: int = 0, causal: bool = False, mask: mx.array | None = None,
                     chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """Attention of q [B, Hq, L, d] over T keys supplied chunk by chunk, with an online softmax.

    Query i sits at absolute position q_pos0 + i, key j at k_pos0 + j; `causal` lets a query see keys
    at positions ≤ its own. `mask` ([.., L, T], bool keep-mask or additive) covers these T keys.
    Returns (out [B, Hq, L, d], logsumexp [B, Hq, L]) in float32; rows that see no key give 0 and -inf.
    """
    B, Hq, L, d = q.shape
    G = Hq // n_kv_heads
    q5 = q.astype(mx.float32).reshape(B, n_kv_heads, G, L, d)
    m = mx.full((B, n_kv_heads, G, L), -mx.inf, mx.float32)
    s_sum = mx.zeros((B, n_kv_heads, G, L), mx.float32)
    acc = mx.zeros((B, n_kv_heads, G, L, d), mx.float32)
    mask5 = _mask_5d(mask, B, n_kv_heads, G, L) if mask is not None else None
    q_pos = (q_pos0 + mx.arange(L))[:, None]
    bounded = B * Hq * L * min(chunk, T) * 4 > EVAL_BYTES
    for k0 in range(0, T, chunk):
        k1 = min(T, k0 + chunk)
        keys, kscale, values, vscale = chunk_fn(k0, k1)
        s = q5 @ keys[:, :, None].swapaxes(-1, -2)  # [B, Hkv, G, L, C]
        if kscale is not None:
            s = s * kscale[:, :, None, None, :]
        s = s * scale
        if mask5 is not None:
            mc = mask5[..., k0:k1]
            s = mx.where(mc, s, -mx.inf) if mc.dtype == mx.bool_ else s + mc.astype(mx.float32)
        if causal:
            k_pos = k_pos0 + mx.arange(k0, k1)
            s = mx.where(k_pos[None, :] <= q_pos, s, -mx.inf)
        m_new = mx.maximum(m, s.max(-1))
        m_safe = mx.where(m_new == -mx.inf, 0.0, m_new)  # fully masked so far: avoid inf - inf
        p = mx.exp(s - m_safe[..., None])
        corr = mx.exp(m - m_safe)
        s_sum = s_sum * corr + p.sum(-1)
        if vscale is not None:
            p = p * vscale[:, :, None, None, :]
        acc = acc * corr[..., None] + p @ values[:, :, None]
        m = m_new
        if bounded and k1 < T:
            mx.eval(m, s_sum, acc)
    out = mx.where(s_sum[..., None] > 0, acc / mx.maximum(s_sum, 1e-30)[..., None], 0.0)
    lse = mx.where(s_sum > 0, m + mx.log(mx.maximum(s_sum, 1e-30)), -mx.inf)
    return out.reshape(B, Hq, L, d), lse.reshape(B, Hq, L)


def packed_attention(q_rot: mx.array, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array,
                     v_norms: mx.array, levels: mx.array, *, bits: int, scale: float, offset: int,
                     causal: bool, valid_len: int, mask: mx.array | None = None,
                     chunk: int = CHUNK, key_bits: int | None = None,
                     key_levels: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Attention in the rotated space straight from packed codes (rq_core.attention.dispatch's reference path).

    Contract:
      q_rot    [B, Hq, L, d]   queries already rotated (q̃ = R q with kv head h // (Hq/Hkv)'s R)
      k_codes  [B, Hkv, T_cap, W] uint32, W = ceil(d·bits/32); rows ≥ valid_len are ignored
      k_norms  [B, Hkv, T_cap] float16 (stored norm m_j; FORMAT.md)
      v_codes, v_norms: same for values
      levels   [2^bits] float32 codebook (unit-variance units)
      scale    softmax scale (e.g. 1/√d); s_j = scale · m_j · ⟨q̃, levels[kidx_j]⟩ / √d
      offset   absolute position of query 0; key j sits at position j
      causal   query i sees keys j ≤ offset + i (with causal=False every valid key is seen)
      mask     optional [.., L, valid_len] keep-mask (bool) or additive mask, broadcastable to [B, Hq, L, T]
      key_bits, key_levels: keys at their own width and codebook (None: `bits`, `levels`)
      levels [n, 2] (and key_levels): pair codebooks, one `bits`-bit field a pair of coordinates
    Returns (õ [B, Hq, L, d] float32 in the rotated space — apply Rᵀ — , logsumexp [B, Hq, L] float32)
    so the result can be merged with attention over another segment (see `merge`).
    """
    split = key_levels is not None
    d = q_rot.shape[-1]
    inv_sqrt_d = 1.0 / math.sqrt(d)
    levels = levels.astype(mx.float32)
    kbits, klevels = (key_bits, key_levels.astype(mx.float32)) if split else (bits, levels)

    def chunk_fn(k0: int, k1: int):
        kscale = k_norms[:, :, k0:k1].astype(mx.float32) * inv_sqrt_d
        vscale = v_norms[:, :, k0:k1].astype(mx.float32) * inv_sqrt_d
        return (decode(k_codes[:, :, k0:k1], klevels, kbits, d), kscale, decode(v_codes[:, :, k0:k1], levels, bits, d),
                vscale)

    return online_attention(q_rot, k_codes.shape[1], valid_len, chunk_fn, scale=scale, q_pos0=offset,
                            causal=causal, mask=mask, chunk=chunk)


def dense_attention(q: mx.array, keys: mx.array, values: mx.array, *, scale: float, offset: int = 0,
                    key_offset: int = 0, causal: bool = False, mask: mx.array | None = None,
                    chunk: int = CHUNK) -> tuple[mx.array, mx.array]:
    """Chunked attention with logsumexp over plain (fp16/fp32) K/V [B, Hkv, T, d]: an fp16 segment."""
    T = keys.shape[2]

    def chunk_fn(k0: int, k1: int):
        return keys[:, :, k0:k1].astype(mx.float32), None, values[:, :, k0:k1].astype(mx.float32), None

    return online_attention(q, keys.shape[1], T, chunk_fn, scale=scale, q_pos0=offset, k_pos0=key_offset,
                            causal=causal, mask=mask, chunk=chunk)


def merge(parts: list[tuple[mx.array, mx.array]]) -> mx.array:
    """Combine (out, lse) of attention over disjoint key segments into attention over their union."""
    if len(parts) == 1:
        return parts[0][0]
    lse = mx.stack([p[1] for p in parts])  # [S, B, H, L]
    top = lse.max(0)
    top = mx.where(top == -mx.inf, 0.0, top)
    w = mx.exp(lse - top)
    total = w.sum(0)
    w = w / mx.maximum(total, 1e-30)
    return sum(w[i][..., None] * parts[i][0] for i in range(len(parts)))


# ---------------------------------------------------------------------------------------------
# Oracle for tests: dequantize everything, then attend with one plain softmax.


def decode(codes: mx.array, levels: mx.array, bits: int, d: int) -> mx.array:
    """[.., W] codes → the codebook's values [.., d] in unit-variance units: levels[idx] for a scalar codebook,
    points[idx] (a pair of coordinates a field) for a pair codebook [n, 2]."""
    if levels.ndim == 2:
        return levels[unpack(codes, bits, d // 2)].reshape(*codes.shape[:-1], d)
    return levels[unpack(codes, bits, d)]


def dequantize_rotated(codes: mx.array, norms: mx.array, levels: mx.array, bits: int, d: int) -> mx.array:
    """[B, H, T, W] codes + [B, H, T] norms → rotated-space vectors m · levels[idx] / √d, float32."""
    return decode(codes, levels.astype(mx.float32), bits, d) * (norms.astype(mx.float32)[..., None] / math.sqrt(d))


def reference_attention(q: mx.array, keys: mx.array, values: mx.array, *, scale: float, offset: int = 0,
                        causal: bool = False, mask: mx.array | None = None) -> mx.array:
    """Plain softmax(q kᵀ·scale + mask) v in float32, materializing all scores (tests only)."""
    B, Hq, L, d = q.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    k = mx.repeat(keys.astype(mx.float32), G, axis=1)
    v = mx.repeat(values.astype(mx.float32), G, axis=1)
    s = (q.astype(mx.float32) @ k.swapaxes(-1, -2)) * scale
    if mask is not None:
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask.astype(mx.float32)
    if causal:
        s = mx.where(mx.arange(T)[None, :] <= (offset + mx.arange(L))[:, None], s, -mx.inf)
    return mx.softmax(s, axis=-1) @ v


def dequantized_attention(q_rot: mx.array, k_codes: mx.array, k_norms: mx.array, v_codes: mx.array,
                          v_norms: mx.array, levels: mx.array, *, bits: int, scale: float, offset: int,
                          causal: bool, valid_len: int, mask: mx.array | None = None) -> mx.array:
    """Same contract as `packed_attention` (output only), by dequantize-then-attend: the oracle."""
    d = q_rot.shape[-1]
    k = dequantize_rotated(k_codes[:, :, :valid_len], k_norms[:, :, :valid_len], levels, bits, d)
    v = dequantize_rotated(v_codes[:, :, :valid_len], v_norms[:, :, :valid_len], levels, bits, d)
    return reference_attention(q_rot, k, v, scale=scale, offset=offset, causal=causal, mask=mask)
