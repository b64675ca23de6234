"""How a compressed cache's attention is computed: one function, `attend`, and its rules (docs/KERNELS.md).

The cache stores (packed codes of its older tokens, an fp16 segment of its newest); this module decides how to attend
over both, from the shapes and the settings in force (rq_core.kernels.config.config()):

  1. nothing packed yet (the prompt)                -> mx.fast SDPA over the fp16 segment
  2. a prompt chunk of more than PREFILL_DECODE_ROWS rows over packed tokens
                                                    -> the packed part decoded (kv_decode on a GPU), one SDPA
  3. RQ_ATTN=fused (default), no array mask, and the fp16 segment empty or (decoding) holding the queries
                                                    -> attn_fused, one launch, the segment as one more split
  4. otherwise, or where the kernel declines the shapes
                                                    -> packed part + fp16 segment attended apart, merged by
                                                       logsumexp; the packed part by the MLX-op reference
                                                       (rq_core.attention.reference) or, with RQ_ATTN=four on a GPU, by the
                                                       four-kernel pipeline `rq profile` times

Each call leaves on its cache which path it took (`attention_path`: (path, why)), so a run reports how many layers
took each (attention_paths: `rq run --json`, `rq bench`, `rq profile`); on a GPU, a shape the fused kernel declines
is named on stderr once (the reference path is 10-25x slower at long contexts). `fused_declines` asks the same
question of shapes alone, without a GPU (tests/test_attention_coverage.py).
"""

from __future__ import annotations

import math
import sys
from collections import Counter, deque
from typing import Iterable, Protocol, Union

import mlx.core as mx

from rq_core.attention import reference as attention
from rq_core.codec.codebook import KVCodebook
from rq_core.kernels import config as env

Mask = Union[None, str, mx.array]  # None, "causal", or an additive/boolean mask [.., L, T]

# the paths `attend` records: the fused kernel, the four-kernel pipeline, the MLX-op reference (packed part and fp16
# segment apart), SDPA over the fp16 segment (nothing packed yet), a prompt chunk over decoded packed tokens
PATHS = ("fused", "four", "reference", "sdpa", "decoded")
_WARNED: set[str] = set()  # fallback lines already printed (one each per process)

# A prompt chunk of more rows than this attends to compressed tokens (kv.prefill_fp16) by decoding them for one fused
# attention call; up to it, the decode kernel (attn_fused takes <= 8 query rows) or the chunked reference path.
PREFILL_DECODE_ROWS = 8


class InflightQueue:
    """Decoded attention outputs queued by a bounded prefill, oldest first: one queue for all layers of a model (the
    model's make_cache shares it through kv_cache.with_edge_layers), so the host runs at most `prefill_inflight`
    layers ahead of the GPU."""

    def __init__(self) -> None:
        self.pending: deque = deque()

    def push(self, out: mx.array, n_ahead: int) -> None:
        mx.async_eval(out)
        self.pending.append(out)
        while len(self.pending) > n_ahead:
            mx.eval(self.pending.popleft())

    def drain(self) -> None:
        while self.pending:
            mx.eval(self.pending.popleft())


class PackedStore(Protocol):
    """What `attend` reads of a compressed cache (rq_core.cache.kv_cache.IsoQuantCache)."""

    offset: int
    packed_len: int
    fp16_len: int
    fp16_window: int
    prefilling: bool
    prefill_inflight: int
    inflight: InflightQueue
    n_kv_heads: int
    head_dim: int
    rotation: object
    v_book: KVCodebook  # the values' codebook; k_book the keys' (the same object unless they have their own)
    k_book: KVCodebook
    bits: int  # the kernels' arguments: v_book's field width and table, k_book's (key_bits None: v_book's)
    key_bits: int | None
    levels: mx.array
    k_levels: mx.array
    k_codes: mx.array
    k_norms: mx.array
    v_codes: mx.array
    v_norms: mx.array

    def fp16_segment(self) -> tuple[mx.array, mx.array]: ...

    def fp16_buffers(self) -> tuple[mx.array, mx.array, int, int]: ...

    def dense_rotation(self) -> mx.array: ...


def attend(store: PackedStore, queries: mx.array, *, scale: float, mask: Mask = None) -> mx.array:
    """Attention of queries [B, Hq, L, D] (the newest L tokens, already appended) over everything `store` holds."""
    cfg = env.config()
    L = queries.shape[2]
    q_pos0 = store.offset - L
    causal = isinstance(mask, str) and L > 1
    arr_mask = mask if isinstance(mask, mx.array) else None

    if store.packed_len == 0:  # all fp16 (the prompt): the fused SDPA kernel does it
        _record(store, "sdpa")
        fk, fv = store.fp16_segment()
        m = None if (isinstance(mask, str) and L == 1) else mask
        return mx.fast.scaled_dot_product_attention(queries, fk, fv, scale=scale, mask=m)
    if store.prefilling and L > PREFILL_DECODE_ROWS and arr_mask is None:
        _record(store, "decoded")
        return _attend_decoded(store, queries, scale=scale, causal=causal, kernels_on=cfg.attention != "reference")
    why = f"RQ_ATTN={cfg.attention}"
    if cfg.attention == "fused":
        if arr_mask is not None:
            why = "an array mask"
        elif store.fp16_len and (store.prefilling or store.fp16_len < L):
            why = f"an fp16 segment of {store.fp16_len} tokens beside {L} queries"
        else:
            out, why = _fused(store, queries, scale=scale, offset=q_pos0, causal=causal)
            if out is not None:
                _record(store, "fused")
                return out
    return _segments(store, queries, scale=scale, offset=q_pos0, causal=causal, mask=arr_mask,
                     four=cfg.attention == "four", why=why)


def _record(store: PackedStore, path: str, why: str | None = None, queries: mx.array | None = None) -> None:
    """Leave on the cache which path its attention took; on a GPU with the default path, name a declined shape on
    stderr once (a fallback that is chosen, RQ_ATTN or RQ_KERNELS, is not reported)."""
    try:
        store.attention_path = (path, why)
    except AttributeError:  # a store that takes no attributes (a test's stand-in)
        pass
    if path in ("fused", "sdpa", "decoded") or why is None or queries is None or env.config().attention != "fused":
        return
    from rq_core.kernels import launch as kernels

    if not kernels.available():
        return
    line = f"rq: attention over compressed KV takes the {path} path, not the fused kernel, for {shape_name(store, queries)}: {why}"
    if line not in _WARNED:
        _WARNED.add(line)
        print(line, file=sys.stderr)


def shape_name(store: PackedStore, queries: mx.array) -> str:
    """A cache's attention shape in words: head dim, heads, rows, codebooks."""
    B, Hq, L, D = queries.shape
    Hkv = store.k_codes.shape[1] if store.k_codes is not None else store.n_kv_heads
    pair = store.levels.ndim == 2
    codes = (f"pair codebooks {store.k_levels.shape[0]}/{store.levels.shape[0]}" if pair
             else f"{store.bits}-bit codes" + (f", {store.key_bits}-bit keys" if store.key_bits else ""))
    return f"head_dim {D}, {Hq} query / {Hkv} kv heads, {L} row(s) each, {codes}"


def attention_paths(caches: Iterable) -> dict[str, int]:
    """{path: caches whose last attention took it} over a model's caches (each compressed layer's own; caches that
    never attended or do not compress are not counted)."""
    got = Counter(c.attention_path[0] for c in caches if getattr(c, "attention_path", None))
    return {p: got[p] for p in PATHS if got[p]}


def format_paths(paths: dict[str, int]) -> str:
    """attention_paths in words: 'fused 46, reference 2' ('none' where nothing was recorded)."""
    return ", ".join(f"{p} {n}" for p, n in paths.items()) or "none"


def fused_declines(backend: str, *, head_dim: int, q_heads: int, kv_heads: int, bits: int, key_bits: int | None = None,
                   pair_points: tuple[int, int] | None = None, L: int = 1, window: bool = True,
                   capacity: int = 256) -> str | None:
    """Why attn_fused would decline a decode step of this shape on `backend` ('cuda' or 'metal'), or None where it
    takes it: the launch plan `attend` uses, asked of shapes alone (no GPU, no arrays). bits / key_bits: the scalar
    codes' widths (key_bits None: the values'); pair_points (keys' points, values' points): pair codebooks, bits
    ignored. capacity: the cache's packed rows (a multiple of its 256-token growth step)."""
    from rq_core.kernels import launch as kernels

    if pair_points:
        pk, pv = pair_points
        bits, key_bits = pv.bit_length() - 1, pk.bit_length() - 1
        nf, lv, klv = head_dim // 2, (pv, 2), (pk, 2)
    else:
        nf, lv, klv = head_dim, (1 << bits,), None if key_bits in (None, bits) else (1 << key_bits,)
        key_bits = None if klv is None else key_bits
    kshape = (1, kv_heads, capacity, nf * (key_bits or bits) // 32)
    vshape = (1, kv_heads, capacity, nf * bits // 32)
    return kernels.fused_plan_declines(backend, (1, q_heads, L, head_dim), mx.float16, kshape, vshape, lv, klv, bits,
                                       key_bits, causal=L > 1, window=window)


def _fused(store: PackedStore, queries: mx.array, *, scale: float, offset: int,
           causal: bool) -> tuple[mx.array | None, str]:
    """(attn_fused over the packed codes with the rotation done in-kernel and the fp16 segment as one more split, None)
    or (None, why) where the kernels do not run here or decline the shapes."""
    from rq_core.kernels import launch as kernels

    if not kernels.available():
        return None, "no GPU kernels here"
    split = _own_key_codes(store, queries.shape)
    if split is None:
        return None, f"code rows of {store.k_codes.shape[3]} / {store.v_codes.shape[3]} words"
    # the segment as the buffers and its rows (no view made); the launches made for this cache's calls kept on it
    window = store.fp16_buffers() if store.fp16_len else None
    try:
        rot, mats = kernels.rotation_args(store.rotation)
        return kernels.fused_attention(
            queries, mats, store.k_codes, store.k_norms, store.v_codes, store.v_norms, store.levels, bits=store.bits,
            scale=scale, valid_len=store.packed_len, offset=offset, causal=causal, rot=rot, window=window,
            key_bits=store.key_bits if split else None, key_levels=store.k_levels if split else None,
            want_lse=False, launches=getattr(store, "fused_launches", None), plan_len=_plan_len(store))[0], ""
    except kernels.KernelUnsupported as e:
        return None, str(e)


def _plan_len(store: PackedStore) -> int:
    """The packed tokens a cache's fused launches are planned for: at least as many as give the most splits, and its
    capacity (from which the long contexts' thread count): so its launch keeps its class (and a layer's traced decode
    graph its trace) from the first decode step to the next capacity step. A short context's splits are then short
    or empty (the kernel divides the valid rows among them); the merge reads them all."""
    from rq_core.kernels import launch as kernels

    return max(store.k_codes.shape[2], 128 * kernels.MAX_SPLITS)


def _own_key_codes(store: PackedStore, qshape: tuple) -> bool | None:
    """Whether the keys go to the kernel with their own width and table (kv.key_bits, pair codebooks); None where the
    code rows do not fit the queries' head dim (or the query heads are not a multiple of the kv heads)."""
    pair = store.v_book.kind == "pair"  # pair codebooks (kv.pair_points): both tables [n, 2]
    key_bits, bits = store.key_bits, store.bits
    Hq, D, Hkv = qshape[1], qshape[3], store.k_codes.shape[1]
    split = key_bits is not None and (key_bits != bits or pair)
    nf = D // 2 if pair else D
    if Hq % Hkv or store.k_codes.shape[3] * 32 != nf * (key_bits if split else bits) \
            or store.v_codes.shape[3] * 32 != nf * bits or (pair and (not split or store.k_levels.ndim != 2)):
        return None
    return split


def decode_launch(store: PackedStore, qshape: tuple, qdtype, scale: float):
    """The fused launch (rq_core.kernels.launch.FusedLaunch) of a one-token decode step whose new token goes to the fp16
    segment (so it is not empty) and whose queries have `qshape` [B, Hq, 1, D], or None where `attend` would not take
    the fused path for it (a traced decode graph runs it: rq_core.models.base.decode_layer). The same launch `attend` makes
    (planned for _plan_len), from the store's state before the token is appended; its window (the segment with the new
    token: at most fp16_window rows) is one split."""
    from rq_core.kernels import launch as kernels

    if env.config().attention != "fused" or not kernels.available() or store.packed_len == 0 or store.prefilling:
        return None
    split = _own_key_codes(store, qshape)
    if qshape[2] != 1 or split is None or not 1 <= store.fp16_window <= kernels.MMA_TILE:
        return None
    rot, mats = kernels.rotation_args(store.rotation)
    try:
        launch = kernels.kept_launch(store.fused_launches, tuple(qshape), qdtype, mats, store.k_codes.shape,
                                     store.v_codes.shape, store.levels, bits=store.bits, scale=scale,
                                     valid_len=store.packed_len, offset=store.offset, rot=rot, window=True,
                                     key_bits=store.key_bits if split else None,
                                     key_levels=store.k_levels if split else None, plan_len=_plan_len(store))
    except kernels.KernelUnsupported:
        return None
    return launch


def _segments(store: PackedStore, queries: mx.array, *, scale: float, offset: int, causal: bool,
              mask: mx.array | None, four: bool, why: str = "") -> mx.array:
    """The packed part in the rotated space and the fp16 segment in the model's, merged by logsumexp."""
    q_rot = store.rotation.forward_queries(queries)
    packed = _four_kernels(store, q_rot, scale=scale, offset=offset, causal=causal) if four and mask is None else None
    _record(store, "four" if packed is not None else "reference", why, queries)
    if packed is None:
        packed = attention.packed_attention(
            q_rot, store.k_codes, store.k_norms, store.v_codes, store.v_norms, store.levels, bits=store.bits,
            key_bits=store.key_bits, key_levels=store.k_levels if store.key_bits else None,
            scale=scale, offset=offset, causal=causal, valid_len=store.packed_len,
            mask=None if mask is None else mask[..., : store.packed_len])
    o, lse = packed
    parts = [(store.rotation.inverse_queries(o), lse)]
    if store.fp16_len:
        fk, fv = store.fp16_segment()
        parts.append(attention.dense_attention(
            queries, fk, fv, scale=scale, offset=offset, key_offset=store.packed_len, causal=causal,
            mask=None if mask is None else mask[..., store.packed_len : store.offset]))
    return attention.merge(parts).astype(queries.dtype)


def _four_kernels(store: PackedStore, q_rot: mx.array, *, scale: float, offset: int,
                  causal: bool) -> tuple[mx.array, mx.array] | None:
    """(õ, lse) over the packed part by qk_dot, softmax and value_accum (queries already rotated), or None where the
    kernels do not run here or decline the shapes."""
    from rq_core.kernels import launch as kernels

    T, L = store.packed_len, q_rot.shape[2]
    if not kernels.available():
        return None
    if causal and offset + 1 >= T:
        causal = False  # every query sees every packed key
    if causal and offset != T - L:
        return None  # a causal window the kernels do not express (they take offset = valid_len - L)
    kb, kl = store.k_book.field_bits, store.k_book.table
    try:
        s = kernels.qk_dot(q_rot, store.k_codes, store.k_norms, kl, bits=kb, scale=scale, valid_len=T, offset=offset,
                           causal=causal)
        lse = mx.logsumexp(s, axis=-1)
        lse = mx.where(lse < -1e29, -mx.inf, lse)
        o = kernels.value_accum(kernels.softmax(s), store.v_codes, store.v_norms, store.levels, bits=store.bits)
    except kernels.KernelUnsupported:
        return None
    return o, lse


def _attend_decoded(store: PackedStore, queries: mx.array, *, scale: float, causal: bool,
                    kernels_on: bool) -> mx.array:
    """A prompt chunk over compressed older tokens (kv.prefill_fp16): the packed part decoded in the model's dtype
    (one layer's K/V, inside this call only), the fp16 segment rotated, one fused attention in the rotated space.
    The chunked float32 path would run (queries x packed tokens) through many small ops per chunk of keys."""
    from rq_core.kernels import launch as kernels

    dt, n, d = queries.dtype, store.packed_len, store.head_dim
    R = store.dense_rotation()  # [H, d, d], y = R x: one matmul each (the op-by-op WHT holds ~20x its input)
    B, Hq, L, _ = queries.shape
    q_rot = (queries.astype(mx.float32).reshape(B, store.n_kv_heads, -1, d) @ R.swapaxes(-1, -2)).astype(dt)
    # decode after this layer's queries exist, so that one layer's decoded K/V are alive at a time (without the
    # edge an evaluation may decode every layer's packed tokens first: they depend only on the cache)
    kc, kn, vc, vn = mx.depends([store.k_codes, store.k_norms, store.v_codes, store.v_norms], [q_rot])
    fk, fv = store.fp16_segment()

    def full(codes: mx.array, norms: mx.array, levels: mx.array, bits: int, fp16: mx.array) -> mx.array:
        """The packed rows decoded, then the fp16 segment's rows rotated: [B, H, n + fp16_len, d] in dt."""
        rot = (fp16.astype(mx.float32) @ R.swapaxes(-1, -2)).astype(dt)
        out = None
        if kernels_on:
            out = kernels.decode_rows(codes, norms, levels, bits=bits, d=d, n=n, dtype=dt, rows=n + store.fp16_len)
        if out is not None:  # one launch on a GPU, into a buffer with room for the segment (no concatenated copy)
            out[:, :, n:] = rot
            return out
        s = (norms[:, :, :n].astype(mx.float32) * (1.0 / math.sqrt(d))).astype(dt)
        return mx.concatenate([attention.decode(codes[:, :, :n], levels.astype(dt), bits, d) * s[..., None], rot],
                              axis=2)

    keys = full(kc, kn, store.k_book.table, store.k_book.field_bits, fk)
    values = full(vc, vn, store.v_book.table, store.v_book.field_bits, fv)
    # mask "causal" aligns the L queries with the last L keys: the chunk's own tokens, as here
    out = mx.fast.scaled_dot_product_attention(q_rot.reshape(B, Hq, L, d), keys, values, scale=scale,
                                               mask="causal" if causal else None)
    out = (out.astype(mx.float32).reshape(B, store.n_kv_heads, -1, d) @ R).reshape(B, Hq, L, d).astype(dt)
    # evaluated here, so that few layers' decoded K/V are alive at once: left to the model's evaluation, MLX held
    # several layers' (H200, 16 layers x 32K, bound 4096: peak +4,521 MiB, +1,433 with a sync a layer, whole prompt
    # in fp16 +3,448; mx.async_eval alone: +4,130, the host runs ahead). With `prefill_inflight` = n > 0 a layer is
    # queued and the one n layers back waited for: the host encodes ahead of the GPU by at most n layers, so the
    # GPU does not idle while the host builds the next layer (a wait each layer cost 12-28% of prefill time).
    if store.prefill_inflight <= 0:
        mx.eval(out)
    else:
        store.inflight.push(out, store.prefill_inflight)
    return out
