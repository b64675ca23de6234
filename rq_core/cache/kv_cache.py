"""KV caches behind one protocol.

A cache owns its keys/values *and* answers attention over them, because a compressed cache must
never hand back a full-precision K or V of the context. Models call `cache.attend(q, k, v, ...)`
with the new tokens' keys/values; the cache appends them and returns attention over everything
(a compressed cache stores, rq_core.attention.dispatch decides how to attend). `state` lists the arrays a cache holds,
what generation evaluates between steps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import mlx.core as mx
import numpy as np

from rq_core.attention.dispatch import InflightQueue, Mask
from rq_core.errors import RQError


# Newest tokens a compressed cache keeps in fp16 unless a recipe or flag says otherwise: on the bundled model
# 32 brought IsoQuant-3 wht_so4 from +2.24% to -0.30% ΔPPL (3 seeds; 16: +0.20%, 8: +2.44%) for ~0.013 of
# fp16's bytes (benchmarks/README.md, kv-study); on a GPU it is one more split of the attention launch (attn_fused).
DEFAULT_FP16_WINDOW = 32

# Compressed layers kept at kv.edge_bits at each end of the model (the first and last full-attention layers) unless a
# recipe or flag says otherwise. Bundled model, 8 windows of 1,024 against fp16 (benchmarks/README.md, "First and last
# layers"): those two layers made 0.0124 of the default cache's 0.0136 mean KL; at 4 bits the total is 0.0071, for
# 0.020 more of fp16's bytes on its 6 layers (48 layers: 0.003).
DEFAULT_EDGE_LAYERS = 1


# isoquant3's codebooks: keys' 128 and values' 32 points a pair of rotated coordinates (7 + 5 bits a pair: 3 bits a
# coordinate, as the scalar codebook's 8 levels). Measured on the bundled model (README, "Needles and bits").
DEFAULT_PAIR_POINTS = (128, 32)

# Prompt tokens a compressing cache keeps in fp16 while it prefills (kv.prefill_fp16): a longer prompt's older tokens are
# compressed as its chunks arrive. H200, Qwen3-30B-A3B shape, against the whole prompt in fp16: 48 layers x 32K peak
# +2,534 MiB against +6,622 (45.0 s against 39.1 s); 8 layers x 128K +920 against +4,872 (38.2 s against 34.0 s);
# bundled model on the CPU: no measurable quality cost (benchmarks/README.md, "Long-prompt prefill").
DEFAULT_PREFILL_FP16 = 4096


def prefill_fp16_value(value: object, what: str) -> int | None:
    """kv.prefill_fp16 as given by a recipe or a flag: a token count >= 0, or "all" (None: the whole prompt stays
    fp16 until the prefill ends)."""
    if isinstance(value, str):
        if value.strip().lower() == "all":
            return None
        try:
            value = int(value)
        except ValueError:
            raise RQError(f"{what} must be a token count or 'all' (got {value!r})") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RQError(f"{what} must be a token count or 'all' (got {value!r})")
    if value < 0:
        raise RQError(f"{what} = {value} must be >= 0")
    return value


@dataclass
class KVSettings:
    """How full-attention layers store K/V. Sliding-window and Mamba layers ignore this.

    The dataclass default is the bare cache (no fp16 window); recipes, `rq run` and `rq eval` default to
    DEFAULT_FP16_WINDOW."""

    mode: str = "fp16"  # fp16 | isoquant3 | turbo3
    bits: int = 3
    rotation: str = "wht_so4"  # wht_so4 | wht | so4 | so3 | dense | rwht_so4
    codebook: str = "sphere"  # sphere | gaussian | path to a codebook TOML
    fp16_window: int = 0  # newest tokens kept in fp16 (0 = off)
    # at most this many prompt tokens held in fp16 while a prompt is prefilled: a longer prompt's older tokens are
    # compressed as its chunks arrive (later chunks attend to them compressed). None ("all"): the whole prompt stays
    # fp16 until end_prefill
    prefill_fp16: int | None = DEFAULT_PREFILL_FP16
    norm_correction: bool = False  # store n / ||c||; measured no better (benchmarks/README.md)
    # values' stored norms scaled by the codebook's reconstruction gain 1 / (1 - D) (codebook.reconstruction_gain), so
    # attention's weighted sum of reconstructed values is not shrunk by D (pair codebooks (128, 32): ~6%). Bundled
    # model, 16 windows of 1,024: mean KL against fp16 0.0212 -> 0.0136, paired ΔNLL +0.0023 ± 0.0052 (README)
    value_gain: bool = True
    seed: int = 0
    # keys at their own width (None: `bits`). 4 with bits 3 kept fp16's needle retention on the bundled model
    # (README, "Needles and bits"). The GPU kernels take both widths.
    key_bits: int | None = None
    # 2-D codebooks (keys' points, values' points): one index a pair of rotated coordinates, log2(n) / 2 bits a
    # coordinate. None: DEFAULT_PAIR_POINTS for isoquant3 at 3 bits (sphere codebook, no key_bits), else scalar
    # codebooks; (): scalar codebooks (the paper's). (128, 32) has IsoQuant-3's bytes and kept needles level with
    # fp16 on the bundled model where the scalar codebook lost them (README, "Needles and bits").
    pair_points: tuple[int, int] | tuple[()] | None = None
    # the first and last `edge_layers` compressed layers store keys and values with scalar codebooks of `edge_bits`
    # (the dataclass default is the bare cache; recipes, `rq run` and `rq eval` default to DEFAULT_EDGE_LAYERS)
    edge_layers: int = 0
    edge_bits: int = 4
    # full-attention layers keep only the newest max_kv_size tokens, in an fp16 ring (rq_core.models.base.
    # SlidingWindowCache; mlx-lm's --max-kv-size); None: every token. fp16 only (a compressed cache has no bounded
    # form). A run's setting (`rq run --max-kv-size`), not a recipe key.
    max_kv_size: int | None = field(default=None, metadata={"recipe": False})

    def edge_settings(self) -> "KVSettings":
        """The settings of an edge layer's cache: this mode, rotation, window and gain at edge_bits, scalar codebooks."""
        return replace(self, bits=self.edge_bits, key_bits=None, pair_points=(), edge_layers=0)

    @property
    def pairs(self) -> tuple[int, int] | None:
        """The pair codebooks' points this setting resolves to, or None for scalar codebooks (at head dims that
        are multiples of 64: pairs_for)."""
        return self.pairs_for(128)

    def pairs_for(self, head_dim: int) -> tuple[int, int] | None:
        """pairs at this head dim: the default holds where its fields fill whole words, as the scalar codebook's do
        (7 d / 64 and 5 d / 64 words a row; at head dim 32, 4 + 3 words against 3 + 3)."""
        if self.mode == "fp16":
            return None
        if self.pair_points is None:
            default = (self.mode == "isoquant3" and self.bits == 3 and self.key_bits is None
                       and self.codebook == "sphere" and head_dim % 64 == 0)
            return DEFAULT_PAIR_POINTS if default else None
        return tuple(self.pair_points) or None


class KVCache(Protocol):
    offset: int  # tokens stored so far (= position of the next token)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
               mask: Mask = None) -> mx.array:
        """Append keys/values [B, Hkv, L, D]; return attention of queries [B, Hq, L, D] over the cache."""
        ...

    def end_prefill(self) -> None:
        """The prompt is done: compressed caches compress what they deferred."""
        ...

    def trim(self, n: int) -> int:
        """Drop the newest n tokens; returns how many were dropped."""
        ...

    def mark(self) -> Callable[[], None]:
        """A function that undoes the one decode step run after it, for that same step to run again (an expert
        pager's speculated step that missed): the cache is then as if the step had run once."""
        ...

    @property
    def state(self) -> list[mx.array]:
        """The arrays the cache holds (what an evaluation between steps must materialize)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes actually held."""
        ...

    @property
    def fp16_nbytes(self) -> int:
        """Bytes an fp16 cache would hold for the same tokens."""
        ...


class FP16Cache:
    """Plain cache in the model's activation dtype, grown in steps; attention by mx.fast SDPA."""

    step = 256

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev = self.offset
        L = keys.shape[2]
        if self.keys is None or prev + L > self.keys.shape[2]:
            B, H, _, D = keys.shape
            n_steps = (self.step + L - 1) // self.step
            new_k = mx.zeros((B, H, n_steps * self.step, D), keys.dtype)
            new_v = mx.zeros((B, H, n_steps * self.step, values.shape[3]), values.dtype)
            if self.keys is not None:
                new_k = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                new_v = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            self.keys, self.values = new_k, new_v
        self.offset += L
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
               mask: Mask = None) -> mx.array:
        k, v = self.update_and_fetch(keys, values)
        if isinstance(mask, str) and queries.shape[2] == 1:
            mask = None  # one query sees the whole cache
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)

    def end_prefill(self) -> None:
        pass

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def mark(self) -> Callable[[], None]:
        offset = self.offset  # a step writes after it (a grown buffer keeps what came before)
        return lambda: self.trim(self.offset - offset)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        per_tok = self.keys[..., :1, :].nbytes + self.values[..., :1, :].nbytes
        return per_tok * self.offset

    @property
    def fp16_nbytes(self) -> int:
        if self.keys is None:
            return 0
        B, H, _, D = self.keys.shape
        return 2 * B * H * self.offset * (D + self.values.shape[3])


# ---------------------------------------------------------------------------------------------
# IsoQuant / TurboQuant: norm + rotation + Lloyd-Max codebook + packing (docs/FORMAT.md)


@functools.lru_cache(maxsize=64)
def row_index(n: int) -> mx.array:
    """int32 [n]: an index a traced decode step takes as an input (the row it writes its token into, as
    mx.slice_update's start; a ring's live slots). Every layer of a step takes the same ones: one array serves them."""
    return mx.array([n], dtype=mx.int32)


def quantize_kv(x: mx.array, rotation, levels: mx.array, bits: int, *, norm_correction: bool = False
                ) -> tuple[mx.array, mx.array]:
    """Quantize vectors x [B, H, T, d] → (codes uint32 [B, H, T, W], stored norms float16 [B, H, T]).
    levels [2^bits]: a scalar codebook; [n, 2]: a pair codebook (bits = log2 n, one field a pair of coordinates)."""
    from rq_core.codec.packing import pack

    d = x.shape[-1]
    x = x.astype(mx.float32)
    n = mx.linalg.norm(x, axis=-1)
    u = x / mx.where(n > 0, n, 1.0)[..., None]  # u = 0 when n = 0
    z = rotation.forward(u) * math.sqrt(d)
    levels = levels.astype(mx.float32)
    if levels.ndim == 2:
        idx = nearest_pair(z, levels)
        m = n
        if norm_correction:
            c_norm = mx.sqrt((levels[idx] ** 2).sum((-1, -2))) / math.sqrt(d)
            m = n / mx.maximum(c_norm, 1e-12)
        return pack(idx, bits), m.astype(mx.float16)
    thresholds = (levels[1:] + levels[:-1]) / 2
    idx = mx.zeros(z.shape, mx.uint32)
    for i in range(thresholds.shape[0]):  # index = number of thresholds < z (no [.., d, 2^b] temporary)
        idx = idx + (z > thresholds[i]).astype(mx.uint32)
    m = n
    if norm_correction:  # store n / ||c|| so the reconstruction has length n
        c_norm = mx.sqrt((levels[idx] ** 2).sum(-1)) / math.sqrt(d)
        m = n / mx.maximum(c_norm, 1e-12)
    return pack(idx, bits), m.astype(mx.float16)


def nearest_pair(z: mx.array, points: mx.array) -> mx.array:
    """Index of the nearest of points [n, 2] for each pair (z_2i, z_2i+1) of z [..., d] → uint32 [..., d / 2], in
    slabs of tokens (the [.., d / 2, n] distances of a 4,096-token chunk would be ~0.5 GB)."""
    *lead, d = z.shape
    p = z.reshape(*lead, d // 2, 2)
    c2 = (points**2).sum(-1)
    flat = p.reshape(-1, d // 2, 2)
    step = max(1, (1 << 20) // ((d // 2) * points.shape[0]))
    out = []
    for a in range(0, flat.shape[0], step):
        q = flat[a : a + step]
        if out:  # after the slab before: an evaluation would otherwise hold every slab's distances at once
            q = mx.depends(q, out[-1])
        # |p|^2 - 2 <q, p> in one op (|q|^2 is the same for all points)
        out.append(mx.argmin(mx.addmm(c2, q, points.T, alpha=-2.0), axis=-1).astype(mx.uint32))
    return mx.concatenate(out, axis=0).reshape(*lead, d // 2)


def dequantize_kv(codes: mx.array, norms: mx.array, rotation, levels: mx.array, bits: int, d: int) -> mx.array:
    """x̂ = m · Rᵀ(levels[idx] / √d), float32 [B, H, T, d] (tests and tools; attention never does this)."""
    from rq_core.attention.reference import dequantize_rotated

    return rotation.inverse(dequantize_rotated(codes, norms, levels, bits, d))


class IsoQuantCache:
    """Compressed KV cache of one full-attention layer: per kv head, norm + rotation + codebook + packing.

    Layout for the GPU path: `k_codes`/`v_codes` uint32 [B, Hkv, T_cap, W] and `k_norms`/`v_norms`
    float16 [B, Hkv, T_cap]; the first `packed_len` rows are valid. Tokens after those (positions
    packed_len .. offset-1) are an fp16 segment: the prompt until `end_prefill()` (so the prompt attends to
    itself in full precision; with `prefill_fp16` set, a longer prompt has its older tokens compressed as its chunks
    arrive), then at most `fp16_window` newest tokens. Decoded tokens are compressed on append.
    Attention runs over both parts and merges them by logsumexp.

    The fp16 segment is `_fk[:, :, _f0 : _f0 + fp16_len]`: compressing its oldest tokens moves `_f0` instead of
    the tokens (on a GPU every array op costs host time in each decode step); the buffer is compacted or shrunk
    when it runs out or is far larger than what it holds (a long prompt's buffer is not kept for a 32-token window).
    """

    step = 256  # packed buffer growth, tokens
    # Made while decoding (or as the prefill ends) on a GPU, the packed buffers have room for an eighth more tokens,
    # from decode_room[0] to decode_room[1]: each new capacity is a new shape for the layer's traced decode graph
    # (rq_core.models.base.decode_layer: traced again) and a copy of the codes
    decode_room = (1024, 8192)
    compress_chunk = 4096  # tokens compressed per graph in end_prefill (bounds temporaries)
    # the same without the GPU kernels: quantize_kv's MLX ops hold ~50 KB a vector (a pair codebook's distances), all
    # of one graph's at once; a prompt in graphs of 16 tokens (below the prefill's own peak), a decode step's window
    # in graphs of 8 (16 put the decode peak above fp16's)
    compress_chunk_ops = 16
    compress_chunk_window = 8
    # a bounded prefill's decoded attention: layers queued ahead of the one waited for (0: wait for each). H200, Qwen3-
    # 30B-A3B shape, 48 layers x 32K: 0 50.2 s, 1 38.3 s (whole prompt in fp16 39.5 s), same peak +2,534 MiB; 8 layers x
    # 128K: 0 +920 MiB, 1 +1,365 (one more layer's decoded K/V), 2 +1,809, times within run-to-run spread
    prefill_inflight = 1

    def __init__(self, *, head_dim: int, n_kv_heads: int, layer: int = 0, bits: int = 3,
                 rotation: str = "wht_so4", codebook: str = "sphere", fp16_window: int = 0,
                 norm_correction: bool = False, seed: int = 0, key_bits: int | None = None,
                 pair_points: tuple[int, int] | None = None, prefill_fp16: int | None = None,
                 value_gain: bool = False) -> None:
        from rq_core.codec.codebook import KVCodebook, check_bits, check_pair_points, reconstruction_gain
        from rq_core.codec.rotation import Rotation, check_dim

        self.head_dim = check_dim(head_dim)
        bits = check_bits(bits)
        if fp16_window < 0:
            raise RQError(f"fp16_window must be >= 0 (got {fp16_window})")
        if prefill_fp16 is not None and prefill_fp16 < 0:
            raise RQError(f"prefill_fp16 must be >= 0 (got {prefill_fp16})")
        self.prefill_fp16 = None if prefill_fp16 is None else int(prefill_fp16)
        self.n_kv_heads = n_kv_heads
        self.layer = layer
        self.rotation = Rotation(head_dim, n_kv_heads, variant=rotation, seed=seed, layer=layer)
        self.fp16_window = int(fp16_window)
        self.norm_correction = norm_correction
        # the values' and the keys' codebooks: the same object unless the keys have their own (kv.key_bits other than
        # bits, or pair codebooks, whose keys and values have their own points and seeds)
        self.pair_points = None
        if pair_points is not None:
            if key_bits is not None:
                raise RQError("kv.key_bits and kv.pair_points cannot both be set")
            if codebook != "sphere":
                raise RQError(f"pair codebooks are fitted to the sphere's marginal (kv.codebook = {codebook!r})")
            self.pair_points = pk, pv = check_pair_points(pair_points)
            self.v_book = KVCodebook.pair(pv, head_dim, "values")
            self.k_book = KVCodebook.pair(pk, head_dim, "keys")
        else:
            self.v_book = KVCodebook.scalar(codebook, bits, head_dim)
            own = key_bits is not None and key_bits != bits
            self.k_book = KVCodebook.scalar(codebook, key_bits, head_dim) if own else self.v_book
        # the kernels' arguments (rq_core.kernels.launch), from the codebooks: each field's table and width in bits
        # (a pair codebook's field holds two coordinates) and a row's words; key_bits None: the keys' are the values'
        self.levels, self.bits, self.words = self.v_book.table, self.v_book.field_bits, self.v_book.row_words(head_dim)
        self.k_levels, self.k_words = self.k_book.table, self.k_book.row_words(head_dim)
        self.key_bits = None if self.k_book is self.v_book else self.k_book.field_bits
        # values' stored norms times this (KVSettings.value_gain), applied as they are compressed (a norm is fp16)
        self.v_gain = reconstruction_gain(np.array(self.levels), head_dim) if value_gain else 1.0
        self.k_codes: mx.array | None = None
        self.v_codes: mx.array | None = None
        self.k_norms: mx.array | None = None
        self.v_norms: mx.array | None = None
        self.packed_len = 0
        self._coded = 0  # tokens with codes written: packed_len, and possibly fp16 tokens coded ahead (_spill)
        self._fk: mx.array | None = None  # fp16 segment's buffer [B, Hkv, cap, d], model dtype
        self._fv: mx.array | None = None
        self._f0 = 0  # the segment's first slot in the buffer
        self.fp16_len = 0
        self.prefilling = True
        self._dense_r: mx.array | None = None  # the rotation as [H, d, d] matrices (a prompt chunk's decoded path)
        # a bounded prefill's queued layers: this cache's own until with_edge_layers gives all of a model's one queue
        self.inflight = InflightQueue()
        self.fused_launches: dict = {}  # the fused attention's prepared launches (rq_core.attention.dispatch._fused)
        self.decode_query: tuple | None = None  # (shape, dtype, scale) of a decode step's queries, once one has attended
        self._step_launch: tuple | None = None  # (what decode_launch depends on, its launch or None): decode_inputs

    @property
    def offset(self) -> int:
        return self.packed_len + self.fp16_len

    # -- storage --
    def _fp16(self, a: int = 0, b: int | None = None) -> tuple[mx.array, mx.array]:
        """Views of the fp16 segment's tokens a .. b (default: all of it)."""
        b = self.fp16_len if b is None else b
        return self._fk[:, :, self._f0 + a : self._f0 + b], self._fv[:, :, self._f0 + a : self._f0 + b]

    def fp16_segment(self) -> tuple[mx.array, mx.array]:
        """Keys and values of the fp16 segment (the tokens after the packed ones), as views."""
        return self._fp16()

    def fp16_buffers(self) -> tuple[mx.array, mx.array, int, int]:
        """The fp16 segment as (keys buffer, values buffer, first row, rows): no view made (the fused kernel reads the
        rows it is told)."""
        return self._fk, self._fv, self._f0, self.fp16_len

    def dense_rotation(self) -> mx.array:
        """The rotation as [H, d, d] matrices, y = R x (made once)."""
        if self._dense_r is None:
            self._dense_r = self.rotation.dense_matrices()
        return self._dense_r

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.k_codes, self.k_norms, self.v_codes, self.v_norms, self._fk, self._fv)
                if a is not None]

    def _fp16_capacity(self, need: int) -> int:
        """Rows of fp16 buffers for `need` tokens: while decoding (a window) rounded up to a quarter `step`, plus a
        quarter step, so a window that slides along is copied to the buffer's front once every ~64 steps; while
        prefilling rounded up to a quarter step up to `step` tokens, then to `step` as FP16Cache grows (never more
        rows than it). A short prompt's 256 rows kept for a 32-token window, with the temporaries of coding it, put
        the cache's decode peak above an fp16 cache's."""
        if not self.prefilling:
            need += self.step // 4
        grain = self.step // 4 if not self.prefilling or need <= self.step else self.step
        return -(-need // grain) * grain

    def _rebuffer(self, need: int, like: tuple[mx.array, mx.array] | None = None) -> None:
        """New fp16 buffers of `_fp16_capacity(need)` rows, the segment copied to their front (`like`: the new keys
        and values, when there are no buffers yet)."""
        lk, lv = (self._fk, self._fv) if like is None else like
        B, H, _, D = lk.shape
        cap = self._fp16_capacity(need)
        new_k = mx.zeros((B, H, cap, D), lk.dtype)
        new_v = mx.zeros((B, H, cap, lv.shape[3]), lv.dtype)
        if self.fp16_len:
            new_k[:, :, : self.fp16_len], new_v[:, :, : self.fp16_len] = self._fp16()
        self._fk, self._fv, self._f0 = new_k, new_v, 0

    def _append_fp16(self, keys: mx.array, values: mx.array) -> None:
        L = keys.shape[2]
        if self._fk is None:
            self.fp16_len = 0
            self._rebuffer(L, like=(keys, values))
        elif self._f0 + self.fp16_len + L > self._fk.shape[2]:
            self._rebuffer(self.fp16_len + L)
        a = self._f0 + self.fp16_len
        self._fk[:, :, a : a + L] = keys
        self._fv[:, :, a : a + L] = values
        self.fp16_len += L

    def _append_packed(self, kc: mx.array, kn: mx.array, vc: mx.array, vn: mx.array) -> None:
        """Write the codes of the next tokens after the `_coded` ones (attention reads the first packed_len)."""
        n = kc.shape[2]
        end = self._coded + n
        if self.k_codes is None or end > self.k_codes.shape[2]:
            B, H = kc.shape[:2]
            cap = self.packed_rows(end, decoding=not self.prefilling)
            bufs = [mx.zeros((B, H, cap, self.k_words), mx.uint32), mx.zeros((B, H, cap), mx.float16),
                    mx.zeros((B, H, cap, self.words), mx.uint32), mx.zeros((B, H, cap), mx.float16)]
            if self._coded:
                old = [self.k_codes, self.k_norms, self.v_codes, self.v_norms]
                for new, o in zip(bufs, old):
                    new[:, :, : self._coded] = o[:, :, : self._coded]
            self.k_codes, self.k_norms, self.v_codes, self.v_norms = bufs
        self.k_codes[:, :, self._coded : end] = kc
        self.k_norms[:, :, self._coded : end] = kn
        self.v_codes[:, :, self._coded : end] = vc
        self.v_norms[:, :, self._coded : end] = vn
        self._coded = end

    @classmethod
    def packed_rows(cls, tokens: int, decoding: bool = True) -> int:
        """Rows the packed buffers are made with to hold `tokens` tokens (`decoding` where the GPU kernels run, whose
        decode steps are traced: with decode_room)."""
        from rq_core.kernels import launch as kernels

        lo, hi = cls.decode_room
        room = min(max(lo, tokens // 8), hi) if decoding and kernels.available() else 0
        return -(-(tokens + room) // cls.step) * cls.step

    def compress(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return quantize_kv(x, self.rotation, self.levels, self.bits, norm_correction=self.norm_correction)

    def compress_kv(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(k_codes, k_norms, v_codes, v_norms) of new tokens: on a GPU one kv_append launch for K and V
        (RQ_APPEND=ops keeps quantize_kv's MLX ops there); on CPU quantize_kv, the reference."""
        from rq_core.kernels import launch as kernels

        out = kernels.append_codes(keys, values, self.rotation, self.levels, self.bits,
                                   norm_correction=self.norm_correction, key_bits=self.key_bits,
                                   key_levels=self.k_levels if self.key_bits else None)
        if out is None:
            if self.k_book is not self.v_book:  # keys at their own width and codebook
                k = quantize_kv(keys, self.rotation, self.k_levels, self.key_bits, norm_correction=self.norm_correction)
                out = (*k, *self.compress(values))
            else:
                out = (*self.compress(keys), *self.compress(values))
        if self.v_gain == 1.0:
            return out
        kc, kn, vc, vn = out  # one op a compressed batch (a decode step's window is coded once per window's steps)
        return kc, kn, vc, (vn.astype(mx.float32) * self.v_gain).astype(mx.float16)

    def _spill(self, keep: int) -> None:
        """Move the oldest fp16 tokens to the packed part so that at most `keep` stay in fp16.

        Their codes may already be written: codes are made for every fp16 token not yet coded whenever a token
        leaving the fp16 part has none, so a decode step of one token writes codes once per `fp16_window` steps (a
        batch of them), not every step; attention reads the first packed_len codes and the fp16 tokens after them,
        exactly as if each token were compressed as it left the window (a token's codes do not depend on when they
        are made)."""
        n = self.fp16_len - keep
        if n <= 0:
            return
        if self._coded < self.packed_len + n:
            from rq_core.kernels import launch as kernels

            a0, m = self._coded - self.packed_len, self.fp16_len - (self._coded - self.packed_len)
            # MLX ops (no kernels) hold float32 temporaries of the tokens they code, several times their fp16 bytes:
            # coded in small graphs, they stay below what the prompt's prefill needed
            chunk = (self.compress_chunk if kernels.available() else
                     self.compress_chunk_window if m <= self.fp16_window + 1 else self.compress_chunk_ops)
            for a in range(0, m, chunk):
                b = min(m, a + chunk)
                kc, kn, vc, vn = self.compress_kv(*self._fp16(a0 + a, a0 + b))
                self._append_packed(kc, kn, vc, vn)
                if m > chunk:
                    from rq_core.models.base import settle_step

                    settle_step()  # within a paged decode step: the experts these tokens' K/V depend on, first
                    mx.eval(self.k_codes, self.k_norms, self.v_codes, self.v_norms)
        self.packed_len += n
        self._f0 += n
        self.fp16_len = keep
        if keep == 0 and self._fk.shape[2] > self.step:
            self._fk = self._fv = None  # the prompt's fp16 buffer is no longer needed
            self._f0 = 0
        elif self.prefilling and self._fk.shape[2] > 2 * self.step + keep:
            self._rebuffer(keep)  # a long prompt's buffer, now holding a bounded prefill's tail
        elif not self.prefilling and self._fk.shape[2] > self._fp16_capacity(keep + 1):
            self._rebuffer(keep + 1)  # a prompt's buffer, now holding a window (and room for the next token)

    # -- protocol --
    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
               mask: Mask = None) -> mx.array:
        from rq_core.attention import dispatch

        L = queries.shape[2]
        if L == 1 and not self.prefilling:
            self.decode_query = (tuple(queries.shape), queries.dtype, scale)
        self._append_fp16(keys, values)
        if not self.prefilling:
            self._spill(self.fp16_window)
        elif self.prefill_fp16 is not None and self.fp16_len > max(keys.shape[2], L, self.prefill_fp16):
            # a long prompt: its older tokens compressed now (never this chunk's own, which attend to themselves)
            self._spill(max(keys.shape[2], L, self.prefill_fp16))
        return dispatch.attend(self, queries, scale=scale, mask=mask)

    # -- a decode step's attention inside a traced graph (rq_core.models.base.decode_layer) --
    def decode_inputs(self) -> tuple[object, list[mx.array]] | None:
        """Ready this cache for a one-token decode step whose attention a traced graph computes (`traced_attend`): what
        `attend` does before its launch (the oldest fp16 tokens spilled, room for the new one), then (the fused launch,
        the graph's arrays). None where `attend` would not take the fused path for it (nothing changed then, but
        tokens spilled that `attend` spills too): the step calls `attend` as written. The graph's new buffers come
        back through `decode_commit`."""
        from rq_core.attention import dispatch
        from rq_core.kernels import config as env
        from rq_core.kernels import launch as kernels

        if self.prefilling or self.decode_query is None or self.fp16_window < 2 or self._fk is None:
            return None
        self._spill(self.fp16_window - 1)  # attend appends, then spills to fp16_window: the same tokens leave
        if self.packed_len == 0:  # nothing packed yet: attend's SDPA over the fp16 tokens
            return None
        if self._f0 + self.fp16_len + 1 > self._fk.shape[2]:
            self._rebuffer(self.fp16_len + 1)
        # the launch depends on the settings and the codes' capacity (the rest is this cache's own): asked again when
        # they change (a step's host time, every layer)
        key = (env.config(), self.decode_query, self.k_codes.shape, self.v_codes.shape, self._fk.shape, self._fk.dtype)
        if self._step_launch is None or self._step_launch[0] != key:
            qshape, qdtype, scale = self.decode_query
            launch = dispatch.decode_launch(self, qshape, qdtype, scale)
            self._step_launch = (key, launch)
        launch = self._step_launch[1]
        # the window's rows (at most fp16_window <= MMA_TILE: decode_launch) are in the buffer (above); its first row
        # must fit the meta's field
        if launch is None or self._f0 >= kernels.WINDOW_FIRST_MAX:
            return None
        row = row_index(self._f0 + self.fp16_len)
        meta = kernels.fused_meta(self.packed_len, self._f0, self.fp16_len + 1)
        return launch, [*launch.static, self._fk, self._fv, row, self.k_codes, self.k_norms, self.v_codes,
                        self.v_norms, launch.counter(), meta]

    @staticmethod
    def traced_attend(launch, arrays: list[mx.array], queries: mx.array, keys: mx.array, values: mx.array, *,
                      scale: float | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """Inside a traced graph, on `decode_inputs`' arrays: the new token's K/V written to its fp16 row, then the
        fused launch (`scale` is unused: the launch was made for the queries' scale, which decode_layer checks):
        (attention output, the new fp16 key and value buffers)."""
        *static, fk, fv, row, kc, kn, vc, vn, counter, meta = arrays
        fk = mx.slice_update(fk, keys.astype(fk.dtype), row, axes=(2,))
        fv = mx.slice_update(fv, values.astype(fv.dtype), row, axes=(2,))
        return launch.launch(queries, static, kc, kn, vc, vn, counter, meta, (fk, fv))[0], fk, fv

    def decode_commit(self, fk: mx.array, fv: mx.array) -> None:
        """The buffers a traced step wrote its token into: the token is the fp16 segment's newest."""
        self._fk, self._fv = fk, fv
        self.fp16_len += 1
        self.attention_path = ("fused", None)

    def end_prefill(self) -> None:
        self.prefilling = False
        self.inflight.drain()
        self._spill(self.fp16_window)
        if self._fk is not None and self._fk.shape[2] > self._fp16_capacity(self.fp16_len + 1):
            self._rebuffer(self.fp16_len + 1)  # a short prompt's buffer: a window's rows, not the prompt's step
        # each layer's compression evaluated as its end_prefill runs: evaluated together, every layer's temporaries
        # (rotation, codebook search) were alive at once (bundled model on the CPU, 2,048 tokens: +227 MiB)
        mx.eval(self.state)

    def trim(self, n: int) -> int:
        n = max(0, min(self.offset, n))
        from_fp16 = min(n, self.fp16_len)
        self.fp16_len -= from_fp16
        self.packed_len -= n - from_fp16
        self._coded = min(self._coded, self.offset)
        return n

    def mark(self) -> Callable[[], None]:
        # Exact for one decode step: its token leaves the fp16 segment again, and the oldest token it pushed
        # into the packed part stays there, where the step run again puts it.
        offset = self.offset
        return lambda: self.trim(self.offset - offset)

    @property
    def nbytes(self) -> int:
        """Codes + norms of the packed tokens, plus the fp16 segment (tokens held, not capacity) at 2 bytes an
        element, as fp16_nbytes counts the reference: the CPU holds both in float32 activations, fp16 and
        bf16 models on a GPU hold 2 bytes."""
        total = 0
        if self.k_codes is not None:
            B, H = self.k_codes.shape[:2]
            total += B * H * self.packed_len * (4 * self.k_words + 4 * self.words + 4)
        if self._fk is not None:
            B, H, _, D = self._fk.shape
            total += B * H * self.fp16_len * D * 2 * 2
        return total

    @property
    def fp16_nbytes(self) -> int:
        ref = self.k_codes if self.k_codes is not None else self._fk
        if ref is None:
            return 0
        B, H = ref.shape[:2]
        return 2 * B * H * self.offset * 2 * self.head_dim

    def packed_ratio(self) -> tuple[int, int]:
        """(bytes of the packed tokens' codes and norms, fp16's bytes for those tokens): the compression itself,
        whatever the fp16 window holds."""
        if self.k_codes is None or not self.packed_len:
            return 0, 0
        B, H = self.k_codes.shape[:2]
        return (B * H * self.packed_len * (4 * self.k_words + 4 * self.words + 4),
                2 * B * H * self.packed_len * 2 * self.head_dim)


class TurboQuantCache(IsoQuantCache):
    """The TurboQuant baseline: a dense Haar-random rotation, same codebook and packing."""

    def __init__(self, **kw) -> None:
        kw["rotation"] = "dense"
        super().__init__(**kw)


KV_MODES = ("fp16", "isoquant3", "turbo3")


def check_edges(edge_layers: object, edge_bits: object, where: str = "kv") -> None:
    """One error line for an edge_layers / edge_bits pair that no cache can take."""
    for name, v in (("edge_layers", edge_layers), ("edge_bits", edge_bits)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise RQError(f"{where}.{name} must be an integer (got {v!r})")
    if edge_layers < 0:
        raise RQError(f"{where}.edge_layers must be >= 0 (got {edge_layers})")
    if not 2 <= edge_bits <= 4:
        raise RQError(f"{where}.edge_bits must be 2, 3 or 4 (got {edge_bits})")


def with_edge_layers(caches: list, settings: KVSettings) -> list:
    """caches with the first and last `settings.edge_layers` compressed ones (full-attention layers; sliding-window and
    Mamba caches are not counted) rebuilt at settings.edge_settings(), and one queue of a bounded prefill's layers
    for all compressed ones. Models' make_cache ends with this."""
    n = settings.edge_layers
    idx = [i for i, c in enumerate(caches) if isinstance(c, IsoQuantCache)]
    if n > 0 and idx:
        edge = settings.edge_settings()
        for i in sorted(set(idx[:n] + idx[-n:])):
            c = caches[i]
            caches[i] = make_kv_cache(edge, layer=c.layer, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim)
    queue = InflightQueue()  # one for the model: a bounded prefill queues at most prefill_inflight layers in all
    for c in caches:
        if isinstance(c, IsoQuantCache):
            c.inflight = queue
    return caches


def make_kv_cache(settings: KVSettings, *, layer: int, n_kv_heads: int, head_dim: int) -> KVCache:
    """The cache for one full-attention layer (`isoquant3`/`turbo3` use `settings.bits`, 3 by default)."""
    if settings.mode == "fp16":
        return FP16Cache()
    if settings.mode not in KV_MODES:
        raise RQError(f"unknown KV mode {settings.mode!r} (choose from: {', '.join(KV_MODES)})")
    cls = TurboQuantCache if settings.mode == "turbo3" else IsoQuantCache
    kw = dict(head_dim=head_dim, n_kv_heads=n_kv_heads, layer=layer, bits=settings.bits,
              codebook=settings.codebook, fp16_window=settings.fp16_window,
              norm_correction=settings.norm_correction, seed=settings.seed, key_bits=settings.key_bits,
              pair_points=settings.pairs_for(head_dim), prefill_fp16=settings.prefill_fp16,
              value_gain=settings.value_gain)
    if cls is IsoQuantCache:
        kw["rotation"] = settings.rotation
    return cls(**kw)
