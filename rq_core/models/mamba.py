"""Mamba2 mixer (as in Nemotron-H) and its per-layer state cache.

The SSM runs in float32 whatever the weights' dtype. Prefill uses the chunked SSD form (exact
for any chunk split, numerically like transformers' `torch_forward`); decode is one O(1)
recurrent update per token. Parameter names follow mlx-lm (`in_proj`, `conv1d`, `A_log`, `D`,
`dt_bias`, `norm`, `out_proj`).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn


class MambaCache:
    """Conv window (last K-1 conv inputs, model dtype) and SSM state [B, H, P, N] (float32).

    Not a KV cache: `attend` does not apply; byte counts report the state actually held (the same
    under every KV mode, so `fp16_nbytes == nbytes`).
    """

    def __init__(self) -> None:
        self.conv_state: mx.array | None = None
        self.ssm_state: mx.array | None = None
        self.offset = 0

    def end_prefill(self) -> None:
        pass

    def trim(self, n: int) -> int:
        return 0  # a recurrent state cannot be rolled back

    def mark(self) -> Callable[[], None]:
        saved = self.conv_state, self.ssm_state, self.offset  # a step replaces them, never writes into them

        def undo() -> None:
            self.conv_state, self.ssm_state, self.offset = saved
        return undo

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.conv_state, self.ssm_state) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    @property
    def fp16_nbytes(self) -> int:
        return self.nbytes


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of the channels of y·silu(z), in float32 (Mamba2's `norm_before_gate=False`)."""

    def __init__(self, dims: int, group_size: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.group_size = group_size
        self.eps = eps

    def __call__(self, y: mx.array, gate: mx.array) -> mx.array:
        y = y.astype(mx.float32) * nn.silu(gate.astype(mx.float32))
        y = mx.unflatten(y, -1, (-1, self.group_size))
        y = mx.fast.rms_norm(y, None, self.eps).flatten(-2)
        return self.weight.astype(mx.float32) * y


def _segsum(a: mx.array) -> mx.array:
    """a [..., T] → S [..., T, T] with S[i, j] = a[j+1] + … + a[i] (i ≥ j), -inf above the diagonal.

    Summed directly (masked cumsum) rather than as a difference of cumsums, which loses precision
    when the decays are large.
    """
    T = a.shape[-1]
    strict = mx.tril(mx.ones((T, T), dtype=mx.bool_), k=-1)
    x = mx.where(strict, mx.broadcast_to(a[..., :, None], (*a.shape, T)), 0.0)
    s = mx.cumsum(x, axis=-2)
    return mx.where(mx.tril(mx.ones((T, T), dtype=mx.bool_)), s, -mx.inf)


def ssd_chunk(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
              state: mx.array) -> tuple[mx.array, mx.array]:
    """One chunk of the SSD scan, all float32.

    x [b, H, l, P], dt [b, H, l] (already softplus'd), A [H] (negative), B, C [b, H, l, N],
    state [b, H, P, N] at the chunk start → (y [b, H, l, P] without the D skip, state at the end).
    """
    a = dt * A[:, None]  # [b, H, l]
    xdt = x * dt[..., None]
    a_cum = mx.cumsum(a, axis=-1)
    decay_in = mx.exp(_segsum(a))  # [b, H, l, l]
    y = ((C @ B.swapaxes(-1, -2)) * decay_in) @ xdt  # intra-chunk
    y = y + (C @ state.swapaxes(-1, -2)) * mx.exp(a_cum)[..., None]  # from the carried state
    decay_out = mx.exp(a_cum[..., -1:] - a_cum)  # [b, H, l]
    state = state * mx.exp(a_cum[..., -1])[..., None, None] + xdt.swapaxes(-1, -2) @ (B * decay_out[..., None])
    return y, state


class Mamba2Mixer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, *, chunk_size: int = 128, eps: float = 1e-5, proj_bias: bool = False,
                 conv_bias: bool = True, dt_min: float = 0.0, dt_max: float = float("inf")):
        super().__init__()
        self.num_heads, self.head_dim, self.state_size = num_heads, head_dim, state_size
        self.n_groups, self.conv_kernel, self.chunk_size = n_groups, conv_kernel, chunk_size
        self.dt_min, self.dt_max = dt_min, dt_max
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=proj_bias)
        # Depthwise causal conv; we pad with the carried window ourselves.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, padding=0, groups=self.conv_dim,
                                bias=conv_bias)
        self.dt_bias = mx.ones((num_heads,))
        self.A_log = mx.log(mx.arange(1, num_heads + 1, dtype=mx.float32))
        self.D = mx.ones((num_heads,))
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // n_groups, eps)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=proj_bias)

    def _conv(self, u: mx.array, prev: Optional[mx.array]) -> tuple[mx.array, mx.array]:
        """(silu(conv) of u after the carried window `prev` (None: zeros), the window carried on).

        The depthwise conv as K shifted multiply-adds (float32, as a conv accumulates), not mx.conv1d: on CUDA MLX runs
        a conv through cuDNN, choosing an engine and allocating its workspace (MLX memory, counted in the peak) at
        every call, every Mamba layer, every decode step."""
        B, L, _ = u.shape
        K = self.conv_kernel
        prev = mx.zeros((B, K - 1, self.conv_dim), dtype=u.dtype) if prev is None else prev.astype(u.dtype)
        padded = mx.concatenate([prev, u], axis=1)
        carried = padded[:, -(K - 1):, :] if K > 1 else padded[:, :0, :]
        if L > 1:  # a prompt chunk: as a view, the carried window would hold the whole chunk's input in memory
            carried = mx.contiguous(carried)
        w = self.conv1d.weight[:, :, 0].T.astype(mx.float32)  # [K, C] (Conv1d: [C, K, 1])
        x = padded.astype(mx.float32)
        y = x[:, :L] * w[0]
        for k in range(1, K):
            y = y + x[:, k:k + L] * w[k]
        if "bias" in self.conv1d:
            y = y + self.conv1d.bias.astype(mx.float32)
        return nn.silu(y.astype(u.dtype)), carried

    def _ssm(self, x: mx.array, Bm: mx.array, Cm: mx.array, dt: mx.array,
             state: Optional[mx.array]) -> tuple[mx.array, mx.array]:
        """(y, the SSM state after these tokens) from the state before them (None: zeros)."""
        b, L, _ = x.shape
        H, P, N, G = self.num_heads, self.head_dim, self.state_size, self.n_groups
        f32 = mx.float32
        x = x.reshape(b, L, H, P).astype(f32).transpose(0, 2, 1, 3)  # [b, H, L, P]
        rep = H // G
        Bm = mx.repeat(Bm.reshape(b, L, G, N).astype(f32), rep, axis=2).transpose(0, 2, 1, 3)  # [b, H, L, N]
        Cm = mx.repeat(Cm.reshape(b, L, G, N).astype(f32), rep, axis=2).transpose(0, 2, 1, 3)
        dt = nn.softplus(dt.astype(f32) + self.dt_bias.astype(f32))
        # transformers' Nemotron-H clamps dt to [time_step_min, inf) in its chunked scan (prefill) but not in
        # its one-token update; we clamp in both so the function does not depend on how the prompt is split.
        dt = mx.clip(dt, self.dt_min, self.dt_max).transpose(0, 2, 1)  # [b, H, L]
        A = -mx.exp(self.A_log.astype(f32))
        state = mx.zeros((b, H, P, N), f32) if state is None else state
        if L == 1:  # decode: h ← exp(dt·A)·h + dt·x⊗B; y = h·C
            dt1 = dt[..., 0]  # [b, H]
            state = state * mx.exp(dt1 * A)[..., None, None] + (dt1[..., None] * x[:, :, 0])[..., None] * Bm
            y = (state @ Cm.swapaxes(-1, -2)).swapaxes(-1, -2)  # [b, H, 1, P]
        else:
            ys = []
            for s in range(0, L, self.chunk_size):
                e = min(L, s + self.chunk_size)
                y_c, state = ssd_chunk(x[:, :, s:e], dt[:, :, s:e], A, Bm[:, :, s:e], Cm[:, :, s:e], state)
                ys.append(y_c)
            y = ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=2)
        y = y + self.D.astype(f32)[:, None, None] * x
        return y.transpose(0, 2, 1, 3).reshape(b, L, H * P), state

    def mix(self, h: mx.array, conv_state: Optional[mx.array] = None,
            ssm_state: Optional[mx.array] = None) -> tuple[mx.array, mx.array, mx.array]:
        """h [B, L, hidden] after the carried states (None: a fresh sequence) → (output, conv state, SSM state)."""
        I, N, G = self.intermediate_size, self.state_size, self.n_groups
        zxbcdt = self.in_proj(h)
        gate, xBC, dt = mx.split(zxbcdt, [I, I + self.conv_dim], axis=-1)
        xBC, conv_state = self._conv(xBC, conv_state)
        x, Bm, Cm = mx.split(xBC, [I, I + G * N], axis=-1)
        y, ssm_state = self._ssm(x, Bm, Cm, dt, ssm_state)
        y = self.norm(y, gate)
        return self.out_proj(y.astype(h.dtype)), conv_state, ssm_state

    def __call__(self, h: mx.array, cache: Optional[MambaCache] = None) -> mx.array:
        if cache is None:
            return self.mix(h)[0]
        y, cache.conv_state, cache.ssm_state = self.mix(h, cache.conv_state, cache.ssm_state)
        cache.offset += h.shape[1]
        return y
