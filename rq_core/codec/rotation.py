"""Rotations for the KV cache: R = R_SO(4) ∘ H_d (docs/FORMAT.md), and the ablation variants.

`rwht_so4` is R_SO(4) ∘ H_d ∘ D_s with D_s a random ±1 diagonal (a randomized Hadamard, as in QuaRot): the same
SO(4) blocks as `wht_so4`, signs from their own stream. On the bundled model (kv-study, 6 seeds, 32-token window)
it lowered the KV cache's mean KL by 0.0051 ± 0.0020 against `wht_so4` and 0.0029 ± 0.0012 against the dense
rotation (paired), with ΔNLL level with both.

`H_d` is the normalized Walsh-Hadamard transform done with butterflies (d·log2 d adds, never a d×d
matmul). `R_SO(4)` rotates each consecutive 4-block v ↦ q_L ⊗ v ⊗ conj(q_R). One `Rotation` covers
all kv heads of one layer; tensors are laid out like MLX attention, [..., H, T, d] (head axis -3).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError

VARIANTS = ("wht_so4", "wht", "so4", "so3", "dense", "rwht_so4")
MIN_DIM, MAX_DIM = 16, 1024


def check_dim(d: int) -> int:
    """d must be a power of two in [16, 1024]; returns it."""
    if not isinstance(d, (int, np.integer)) or d < MIN_DIM or d > MAX_DIM or d & (d - 1):
        raise RQError(f"head dim {d} is not supported: it must be a power of two from {MIN_DIM} to {MAX_DIM}")
    return int(d)


def check_variant(name: str) -> str:
    if name not in VARIANTS:
        raise RQError(f"unknown rotation {name!r} (choose from: {', '.join(VARIANTS)})")
    return name


# ---------------------------------------------------------------------------------------------
# Walsh-Hadamard transform


def wht(x: mx.array) -> mx.array:
    """Normalized Sylvester-Hadamard transform over the last axis (symmetric, its own inverse)."""
    d = x.shape[-1]
    check_dim(d)
    lead = x.shape[:-1]
    h = 1
    while h < d:
        # Pairs (i, i+h) inside blocks of 2h: view as [..., d/2h, 2, h].
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = mx.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return x * (1.0 / math.sqrt(d))


def hadamard_matrix(d: int) -> np.ndarray:
    """Dense normalized Sylvester Hadamard matrix (tests and kernels' reference only)."""
    H = np.ones((1, 1))
    while H.shape[0] < d:
        H = np.block([[H, H], [H, -H]])
    return H / math.sqrt(d)


# ---------------------------------------------------------------------------------------------
# Quaternion blocks


def quat_left(q: np.ndarray) -> np.ndarray:
    """Matrix of v ↦ q ⊗ v (Hamilton product), q [..., 4] = (w, x, y, z) → [..., 4, 4]."""
    w, x, y, z = np.moveaxis(q, -1, 0)
    rows = [[w, -x, -y, -z], [x, w, -z, y], [y, z, w, -x], [z, -y, x, w]]
    return np.stack([np.stack(r, axis=-1) for r in rows], axis=-2)


def quat_right(p: np.ndarray) -> np.ndarray:
    """Matrix of v ↦ v ⊗ p, p [..., 4] → [..., 4, 4]."""
    w, x, y, z = np.moveaxis(p, -1, 0)
    rows = [[w, -x, -y, -z], [x, w, z, -y], [y, -z, w, x], [z, y, -x, w]]
    return np.stack([np.stack(r, axis=-1) for r in rows], axis=-2)


def quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton product a ⊗ b over the last axis (reference for tests)."""
    aw, ax, ay, az = np.moveaxis(a, -1, 0)
    bw, bx, by, bz = np.moveaxis(b, -1, 0)
    return np.stack(
        [
            aw * bw - ax * bx - ay * by - az * bz,
            aw * bx + ax * bw + ay * bz - az * by,
            aw * by - ax * bz + ay * bw + az * bx,
            aw * bz + ax * by - ay * bx + az * bw,
        ],
        axis=-1,
    )


def quat_conj(q: np.ndarray) -> np.ndarray:
    return q * np.array([1.0, -1.0, -1.0, -1.0])


def head_params(variant: str, d: int, seed: int, layer: int, kv_head: int) -> np.ndarray:
    """Raw parameters of one head; see `_head_params` (cached: a dense QR is slow on a busy CPU)."""
    return _head_params(variant, d, seed, layer, kv_head).copy()


@functools.lru_cache(maxsize=4096)
def _head_params(variant: str, d: int, seed: int, layer: int, kv_head: int) -> np.ndarray:
    """Raw parameters of one head (float64): [d/4, 2, 4] unit quaternions (q_L, q_R), or [d, d] for dense.

    Per FORMAT.md: rng = default_rng([seed, layer, kv_head]); g = standard_normal((d//4, 2, 4)),
    normalised; `so3` uses q_R = q_L; `dense` is the QR of standard_normal((d, d)) with signs fixed.
    """
    rng = np.random.default_rng([seed, layer, kv_head])
    if variant == "dense":
        Q, R = np.linalg.qr(rng.standard_normal((d, d)))
        return Q * np.sign(np.diag(R))[None, :]
    g = rng.standard_normal((d // 4, 2, 4))
    g /= np.linalg.norm(g, axis=-1, keepdims=True)
    if variant == "so3":
        g[:, 1] = g[:, 0]
    return g


@functools.lru_cache(maxsize=4096)
def _head_signs(d: int, seed: int, layer: int, kv_head: int) -> np.ndarray:
    """D_s of one head (`rwht_so4`): ±1.0 [d], rng = default_rng([seed, layer, kv_head, 1]); x_i flips where
    rng.random(d)[i] < 0.5 (FORMAT.md)."""
    rng = np.random.default_rng([seed, layer, kv_head, 1])
    return np.where(rng.random(d) < 0.5, -1.0, 1.0)


def block_matrices_np(q: np.ndarray) -> np.ndarray:
    """[d/4, 2, 4] (q_L, q_R) → [d/4, 4, 4] with M = L(q_L)·R(conj q_R), so y_blk = M · v_blk."""
    return quat_left(q[:, 0]) @ quat_right(quat_conj(q[:, 1]))


# ---------------------------------------------------------------------------------------------


class Rotation:
    """The rotation of one layer, one per kv head. x: [..., H, T, d] with head axis -3."""

    def __init__(self, d: int, n_heads: int, *, variant: str = "wht_so4", seed: int = 0, layer: int = 0):
        self.d = check_dim(d)
        self.variant = check_variant(variant)
        self.n_heads = int(n_heads)
        self.seed, self.layer = int(seed), int(layer)
        self.use_wht = variant in ("wht_so4", "wht", "rwht_so4")
        self._blocks: mx.array | None = None  # [H, 1, d/4, 4, 4] float32, broadcast over T
        self._dense: mx.array | None = None  # [H, d, d] float32
        self._signs: mx.array | None = None  # [H, 1, d] float32 ±1 (rwht_so4), broadcast over T
        block_variant = "wht_so4" if variant == "rwht_so4" else variant  # the same SO(4) blocks
        params = [head_params(block_variant, d, seed, layer, h) for h in range(n_heads)]
        if variant == "rwht_so4":
            self._signs_np = np.stack([_head_signs(d, seed, layer, h) for h in range(n_heads)]).astype(np.float32)
            self._signs = mx.array(self._signs_np)[:, None]
        if variant == "dense":
            self._dense_np = np.stack(params).astype(np.float32)
            self._dense = mx.array(self._dense_np)
        elif variant != "wht":
            self._quats = np.stack(params)  # [H, d/4, 2, 4]
            self._blocks_np = np.stack([block_matrices_np(p) for p in params]).astype(np.float32)
            self._blocks = mx.array(self._blocks_np)[:, None]

    # -- costs (per head) --
    @property
    def param_count(self) -> int:
        """Free parameters stored per kv head (256 for wht_so4 at d=128; d² for dense)."""
        d = self.d
        return {"wht_so4": 2 * d, "so4": 2 * d, "so3": d, "wht": 0, "dense": d * d, "rwht_so4": 3 * d}[self.variant]

    @property
    def fma_count(self) -> int:
        """Multiply-adds (WHT adds counted as one each) to rotate one vector (1,408 for wht_so4 at d=128)."""
        d = self.d
        wht_ops = d * int(math.log2(d)) if self.use_wht else 0
        blocks = 4 * d if self.variant in ("wht_so4", "so4", "so3", "rwht_so4") else 0
        signs = d if self._signs is not None else 0
        return d * d if self.variant == "dense" else wht_ops + blocks + signs

    def block_matrices(self) -> mx.array:
        """[H, d/4, 4, 4] float32 row-major, y_blk = M · v_blk (identity blocks for `wht`, error for `dense`)."""
        if self.variant == "dense":
            raise RQError("the dense rotation has no 4×4 blocks; use dense_matrices()")
        if self._blocks is None:
            return mx.array(np.tile(np.eye(4, dtype=np.float32), (self.n_heads, self.d // 4, 1, 1)))
        return self._blocks[:, 0]

    def sign_vectors(self) -> mx.array | None:
        """[H, d] float32 ±1, applied before the WHT (`rwht_so4`), else None."""
        return None if self._signs is None else self._signs[:, 0]

    def dense_matrices(self) -> mx.array:
        """[H, d, d] float32 with y = R u (any variant; built from forward on the identity)."""
        if self._dense is not None:
            return self._dense
        eye = mx.broadcast_to(mx.eye(self.d), (self.n_heads, self.d, self.d))
        return self.forward(eye).swapaxes(-1, -2)  # rows of forward(I) are R e_i = columns of R

    # -- application --
    def _check(self, x: mx.array) -> None:
        if x.ndim < 3 or x.shape[-1] != self.d or x.shape[-3] != self.n_heads:
            raise ValueError(f"expected [..., {self.n_heads}, T, {self.d}], got {tuple(x.shape)}")

    def _blocks_apply(self, x: mx.array, M: mx.array) -> mx.array:
        lead = x.shape[:-1]
        v = x.reshape(*lead, self.d // 4, 1, 4)
        return (v * M).sum(-1).reshape(*lead, self.d)

    def forward(self, x: mx.array) -> mx.array:
        """y = R x per head (x in float32 or wider; returns float32)."""
        self._check(x)
        x = x.astype(mx.float32)
        if self._dense is not None:
            return x @ self._dense.swapaxes(-1, -2)
        if self._signs is not None:
            x = x * self._signs
        if self.use_wht:
            x = wht(x)
        if self._blocks is not None:
            x = self._blocks_apply(x, self._blocks)
        return x

    def inverse(self, y: mx.array) -> mx.array:
        """x = Rᵀ y per head."""
        self._check(y)
        y = y.astype(mx.float32)
        if self._dense is not None:
            return y @ self._dense
        if self._blocks is not None:
            y = self._blocks_apply(y, self._blocks.swapaxes(-1, -2))
        if self.use_wht:
            y = wht(y)
        if self._signs is not None:
            y = y * self._signs
        return y

    def _gqa(self, q: mx.array, fn) -> mx.array:
        B, Hq, L, d = q.shape
        if Hq % self.n_heads:
            raise ValueError(f"{Hq} query heads is not a multiple of {self.n_heads} kv heads")
        G = Hq // self.n_heads
        # Query head h uses kv head h // G: heads are grouped contiguously, so fold G into T.
        return fn(q.reshape(B, self.n_heads, G * L, d)).reshape(B, Hq, L, d)

    def forward_queries(self, q: mx.array) -> mx.array:
        """Rotate queries [B, Hq, L, d] with GQA (query head h → kv head h // (Hq/Hkv))."""
        return self._gqa(q, self.forward)

    def inverse_queries(self, o: mx.array) -> mx.array:
        """Rᵀ for per-query-head outputs [B, Hq, L, d]."""
        return self._gqa(o, self.inverse)

    def __repr__(self) -> str:
        return f"Rotation({self.variant}, d={self.d}, heads={self.n_heads}, seed={self.seed}, layer={self.layer})"
