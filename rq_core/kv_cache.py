"""KV caches behind one protocol.

A cache owns its keys/values *and* knows how to attend over them, because a compressed cache must
never hand back a full-precision K or V of the context. Models call `cache.attend(q, k, v, ...)`
with the new tokens' keys/values; the cache appends them and returns attention over everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

import mlx.core as mx

Mask = Union[None, str, mx.array]  # None, "causal", or an additive/boolean mask [.., L, T]


@dataclass
class KVSettings:
    """How full-attention layers store K/V. Sliding-window and Mamba layers ignore this."""

    mode: str = "fp16"  # fp16 | isoquant3 | turbo3
    bits: int = 3
    rotation: str = "wht_so4"  # wht_so4 | wht | so4 | so3 | dense
    codebook: str = "sphere"  # sphere | gaussian | path to a codebook TOML
    fp16_window: int = 0  # newest tokens kept in fp16 (0 = off)
    norm_correction: bool = True
    seed: int = 0


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


def make_kv_cache(settings: KVSettings, *, layer: int, n_kv_heads: int, head_dim: int) -> KVCache:
    """The cache for one full-attention layer."""
    if settings.mode == "fp16":
        return FP16Cache()
    from rq_core.errors import RQError

    raise RQError(f"KV mode {settings.mode!r} is not available yet (choose from: fp16)")
