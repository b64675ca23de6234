"""b-bit indices ↔ uint32 words (docs/FORMAT.md, "Packing").

Little-endian bit stream per row: index i occupies bits [b·i, b·i + b); word k holds bits
[32k, 32k + 32); a value may straddle two words (b = 3). Words per row = ceil(n·b / 32).
MLX versions are vectorized (no Python loop over values); numpy mirrors are for tests and tools.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError

PACK_BITS = (1, 2, 3, 4, 5, 6, 7, 8)  # 5-8: the pair codebooks' fields (one index a pair of coordinates)


def _check(bits: int) -> int:
    if bits not in PACK_BITS:
        raise RQError(f"packed fields must be 1 to 8 bits wide (got {bits})")
    return bits


def words_per_row(n: int, bits: int) -> int:
    return (n * _check(bits) + 31) // 32


@functools.lru_cache(maxsize=None)
def _pack_tables(bits: int):
    """One period of the stream: P values fill Wp whole words. Per (value j, word w) shift tables."""
    P = 32 // math.gcd(bits, 32)
    Wp = P * bits // 32
    lsh = np.zeros((P, Wp), np.uint32)
    rsh = np.zeros((P, Wp), np.uint32)
    lo = np.zeros((P, Wp), bool)  # value j's low bits land in word w at shift lsh
    hi = np.zeros((P, Wp), bool)  # value j's high bits spill into word w, shifted right by rsh
    for j in range(P):
        k, s = divmod(j * bits, 32)
        lo[j, k], lsh[j, k] = True, s
        if s + bits > 32:
            hi[j, k + 1], rsh[j, k + 1] = True, 32 - s
    return P, Wp, mx.array(lsh), mx.array(rsh), mx.array(lo), mx.array(hi)


def pack(idx: mx.array, bits: int) -> mx.array:
    """Pack indices [..., n] (values < 2^bits) into uint32 words [..., ceil(n·bits/32)]."""
    P, Wp, lsh, rsh, lo, hi = _pack_tables(_check(bits))
    *lead, n = idx.shape
    W = (n * bits + 31) // 32
    x = idx.astype(mx.uint32) & ((1 << bits) - 1)
    n_per = -(-n // P)
    if n_per * P != n:
        x = mx.concatenate([x, mx.zeros((*lead, n_per * P - n), mx.uint32)], axis=-1)
    x = x.reshape(*lead, n_per, P, 1)
    zero = mx.zeros((1,), mx.uint32)
    part = mx.where(lo, x << lsh, zero) | mx.where(hi, x >> rsh, zero)  # [..., n_per, P, Wp]
    # Bits of different values never overlap, so OR over j equals a sum.
    words = part.sum(axis=-2).astype(mx.uint32).reshape(*lead, n_per * Wp)
    return words[..., :W]


@functools.lru_cache(maxsize=None)
def _byte_tables(bits: int, n: int) -> tuple[mx.array, mx.array]:
    """Value i's first byte and its shift in that byte (bits <= 8: a value spans at most two bytes)."""
    pos = np.arange(n, dtype=np.int64) * bits
    return mx.array((pos >> 3).astype(np.int32)), mx.array((pos & 7).astype(np.uint32))


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Unpack uint32 words [..., W] into n indices [..., n] (uint32).

    Reads the words as their little-endian bytes: a run of `bits` bytes holds exactly 8 values
    (3 bytes = 8 three-bit codes), so no value straddles a unit and no gather is needed
    (about 5x faster than gathering words on the CPU for d = 128, 3 bits).
    """
    _check(bits)
    W = words.shape[-1]
    if W < (n * bits + 31) // 32:
        raise ValueError(f"{W} words cannot hold {n} {bits}-bit values")
    lead = words.shape[:-1]
    b = mx.view(mx.contiguous(words.astype(mx.uint32)), mx.uint8).astype(mx.uint32)  # [..., 4W]
    if bits > 4:  # 8 values would overflow a 32-bit unit: each value from the two bytes it touches
        lo, sh = _byte_tables(bits, n)
        b = mx.concatenate([b, mx.zeros((*lead, 1), mx.uint32)], axis=-1)
        two = mx.take(b, lo, axis=-1) | (mx.take(b, lo + 1, axis=-1) << 8)
        return (two >> sh) & ((1 << bits) - 1)
    if (4 * W) % bits:
        b = mx.concatenate([b, mx.zeros((*lead, bits - (4 * W) % bits), mx.uint32)], axis=-1)
    g = b.reshape(*lead, -1, bits)  # units of `bits` bytes = 8 values each
    unit = g[..., 0]
    for i in range(1, bits):
        unit = unit | (g[..., i] << (8 * i))
    shifts = mx.arange(0, 8 * bits, bits, dtype=mx.uint32)
    vals = (unit[..., None] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(*lead, -1)[..., :n]


# ---------------------------------------------------------------------------------------------
# numpy mirrors (bit by bit; slow but obviously right)


def pack_np(idx: np.ndarray, bits: int) -> np.ndarray:
    _check(bits)
    idx = np.asarray(idx)
    *lead, n = idx.shape
    W = (n * bits + 31) // 32
    bitsarr = ((idx[..., :, None].astype(np.uint64) >> np.arange(bits, dtype=np.uint64)) & 1).reshape(*lead, n * bits)
    stream = np.zeros((*lead, W * 32), np.uint64)
    stream[..., : n * bits] = bitsarr
    stream = stream.reshape(*lead, W, 32)
    return (stream << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32)


def unpack_np(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    _check(bits)
    words = np.asarray(words, dtype=np.uint32)
    *lead, W = words.shape
    stream = ((words[..., :, None].astype(np.uint64) >> np.arange(32, dtype=np.uint64)) & 1).reshape(*lead, W * 32)
    vals = stream[..., : n * bits].reshape(*lead, n, bits)
    return (vals << np.arange(bits, dtype=np.uint64)).sum(-1).astype(np.uint32)
