"""attn_fused stood in for by MLX ops, for CPU tests of the code around a traced decode step's launch
(rq_core.models.base.decode_layer, IsoQuantCache.decode_inputs / traced_attend)."""

from __future__ import annotations

import mlx.core as mx

from rq_core.cache.kv_cache import IsoQuantCache, dequantize_kv


class RefLaunch:
    """attn_fused's inputs in, its output out, by MLX ops: packed rows below meta[0], window rows meta[1] >> 8 ..
    + (meta[1] & 255) of the whole fp16 buffers; everything else in the buffers is ignored (it holds junk here)."""

    calls = 0

    def __init__(self, cache: IsoQuantCache) -> None:
        # the codebooks go in as the graph's inputs (as the kernel's consts do); the plan holds what the launch's code
        # depends on: the codes' widths, the rotation's kind, the capacity (a real plan's splits follow it)
        self.cache, self.static = cache, [cache.k_levels, cache.levels]
        self.plan = ("reference", cache.k_codes.shape[2], cache.k_book.field_bits, cache.bits, cache.rotation.variant,
                     cache.head_dim, type(cache))

    def counter(self) -> mx.array:
        return mx.zeros((8,), mx.uint32)

    def launch(self, q, static, kc, kn, vc, vn, counter, meta, window):
        RefLaunch.calls += 1
        if kc.shape[2] != self.plan[1]:  # a real launch's splits are planned for the capacity it was made for
            raise ValueError(f"a launch planned for {self.plan[1]} rows given {kc.shape[2]}")
        c = self.cache
        d, scale = c.head_dim, c.decode_query[2]
        k_levels, levels = static
        K = dequantize_kv(kc, kn, c.rotation, k_levels, self.plan[2], d)
        V = dequantize_kv(vc, vn, c.rotation, levels, self.plan[3], d)
        fk, fv = window
        cap, wcap = K.shape[2], fk.shape[2]
        Ka = mx.concatenate([K, fk.astype(mx.float32)], axis=2)
        Va = mx.concatenate([V, fv.astype(mx.float32)], axis=2)
        i = mx.arange(cap + wcap)
        first, rows = meta[1] >> 8, meta[1] & 255
        seen = (i < meta[0]) | ((i >= cap + first) & (i < cap + first + rows))
        B, Hq, L, _ = q.shape
        Hkv = K.shape[1]
        qg = q.astype(mx.float32).reshape(B, Hkv, Hq // Hkv * L, d)
        s = mx.where(seen, (qg @ Ka.swapaxes(-1, -2)) * scale, -mx.inf)
        out = mx.softmax(s, axis=-1) @ Va
        return [out.reshape(B, Hq, L, d).astype(q.dtype), None]
