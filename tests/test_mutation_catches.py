"""Tests written for bugs of the mutation run (tests/mutations.py) that the other tests let through, grouped by
module. Numbers are checked against independent float64 numpy computations, with each tolerance stated next to
the value measured on the real code; paths and stops against what the code must do, counted by hand."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from _tiny_models import TINY


# --------------------------------------------------------------------------------------------- rotation


def _hamilton(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    aw, ax, ay, az = np.moveaxis(a, -1, 0)
    bw, bx, by, bz = np.moveaxis(b, -1, 0)
    return np.stack([aw * bw - ax * bx - ay * by - az * bz, aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx, aw * bz + ax * by - ay * bx + az * bw], -1)


@pytest.mark.parametrize("variant", ["so4", "wht_so4", "rwht_so4"])
def test_rotation_matches_format_md_by_quaternions(variant: str) -> None:
    """forward(x) = q_L ⊗ blk ⊗ conj(q_R) of H_d(D_s x) per 4-block, from FORMAT.md's rng streams, in float64 with
    this test's own Hamilton product; inverse undoes it. Measured max error 3.4e-7 (float32); bound 1e-5."""
    from rq_core.codec.rotation import Rotation, hadamard_matrix

    d, H, seed, layer = 32, 2, 3, 1
    x = np.random.default_rng(5).standard_normal((1, H, 4, d))
    want = np.empty_like(x)
    for h in range(H):
        g = np.random.default_rng([seed, layer, h]).standard_normal((d // 4, 2, 4))
        g /= np.linalg.norm(g, axis=-1, keepdims=True)
        v = x[0, h]
        if variant == "rwht_so4":  # x_i flips where rng.random(d)[i] < 0.5
            v = v * np.where(np.random.default_rng([seed, layer, h, 1]).random(d) < 0.5, -1.0, 1.0)
        if variant != "so4":
            v = v @ hadamard_matrix(d).T
        conj_r = g[:, 1] * np.array([1.0, -1.0, -1.0, -1.0])
        want[0, h] = _hamilton(_hamilton(g[None, :, 0], v.reshape(-1, d // 4, 4)), conj_r[None]).reshape(-1, d)
    r = Rotation(d, H, variant=variant, seed=seed, layer=layer)
    # float32 against the float64 quaternion products: measured 3.4e-7 and 2.9e-7 at most; 3x that
    assert np.abs(np.array(r.forward(mx.array(x.astype(np.float32)))) - want).max() < 1e-6
    assert np.abs(np.array(r.inverse(mx.array(want.astype(np.float32)))) - x).max() < 1e-6


# --------------------------------------------------------------------------------------------- models


def _rope_np(x: np.ndarray, theta: float, offset: int) -> np.ndarray:
    """Non-traditional RoPE (halves rotated), float64."""
    L, D = x.shape[-2], x.shape[-1]
    inv = theta ** (-np.arange(D // 2) * 2.0 / D)
    ang = (offset + np.arange(L))[:, None] * inv[None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x1 * np.sin(ang) + x2 * np.cos(ang)], -1)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_qwen_rope_uses_config_theta(family: str) -> None:
    """rope_theta 1e6 (the goldens use 1e4, the default): the layer's RoPE against numpy's. Measured 1.5e-6 against
    theta 1e6, 6.0 against 1e4; bound 1e-4."""
    from rq_core.checkpoint import build_model

    cfg = json.loads(json.dumps(TINY[family]))
    cfg["rope_theta"] = 1e6
    att = build_model(cfg).layers[0].self_attn
    x = np.random.default_rng(0).standard_normal((1, 2, 40, 32))
    got = np.array(att.rope(mx.array(x.astype(np.float32)), offset=5))
    assert np.abs(got - _rope_np(x, 1e6, 5)).max() < 5e-6  # measured 1.5e-6 (float32 angles at theta 1e6)


# --------------------------------------------------------------------------------------------- generate


class _ChainModel:
    """Greedy continuation t -> t + 1 (mod V): logits one-hot at the last input token + 1; no caches."""

    V = 16

    def __call__(self, inputs: mx.array, cache=None, last: bool = False) -> mx.array:
        nxt = (inputs[0, -1].item() + 1) % self.V
        row = mx.where(mx.arange(self.V) == nxt, 10.0, 0.0)
        return mx.broadcast_to(row, (1, inputs.shape[1], self.V))

    def make_cache(self, kv=None) -> list:
        return []


def test_generate_stops_at_eos_and_leaves_it_out() -> None:
    from rq_core.generate import generate

    res = generate(_ChainModel(), [3], max_tokens=10, eos_token_ids=[6])
    assert res.tokens == [4, 5] and res.stop_reason == "eos"


def test_generate_stops_at_the_context_length() -> None:
    from rq_core.generate import generate

    res = generate(_ChainModel(), [1, 2, 3], max_tokens=10, context_length=6)
    assert res.tokens == [4, 5, 6] and res.stop_reason == "context"
    assert generate(_ChainModel(), [1, 2, 3], max_tokens=2, context_length=6).tokens == [4, 5]


# --------------------------------------------------------------------------------------------- pack (page index)


@pytest.mark.parametrize("name", ["..", ".", "../p.bin", "sub/p.bin", "/abs/p.bin", "p\0.bin", ""])
def test_page_index_refuses_a_file_name_outside_the_pack(name: str) -> None:
    from rq_core.errors import RQError
    from rq_core.paging.pack import check_layer

    with pytest.raises(RQError, match="plain file name inside the pack folder"):
        check_layer({"file": name}, "index.json")


def test_page_index_takes_a_plain_file_name() -> None:
    """The same entry with a plain name passes the name check (and fails on the next field)."""
    from rq_core.errors import RQError
    from rq_core.paging.pack import check_layer

    with pytest.raises(RQError, match="num_experts must be a positive integer"):
        check_layer({"file": "..p.bin"}, "index.json")


# --------------------------------------------------------------------------------------------- codebook (shipped pairs)


@pytest.mark.parametrize("role, n", [("values", 32), ("keys", 128)])
def test_shipped_pair_codebook_is_a_lloyd_fixed_point(role: str, n: int) -> None:
    """isoquant3's default pair codebooks at head dim 128 (rq_core/assets/pair_codebooks.json) against their own
    training set (codebook._pair_lloyd's: 4,096 vectors √d·u from default_rng(seed)): one more Lloyd step moves no
    point by more than 0.03. Measured 0.0069 (32 points) and 0.0089 (128); a point moved by +1.0: 0.14 and 0.053."""
    import math

    from rq_core.codec.codebook import _PAIR_ASSET, PAIR_SEEDS

    d, seed = 128, PAIR_SEEDS[role]
    pts = np.asarray(json.loads(_PAIR_ASSET.read_text())[f"d{d}_n{n}_s{seed}"], np.float64).reshape(n, 2)
    u = np.random.default_rng(seed).standard_normal((4096, d))
    z = (u / np.linalg.norm(u, axis=1, keepdims=True) * math.sqrt(d)).reshape(-1, 2).astype(np.float32)
    c = pts.astype(np.float32)
    a = np.concatenate([((c**2).sum(1) - 2 * (z[s : s + 32768, :1] * c[:, 0] + z[s : s + 32768, 1:] * c[:, 1]))
                        .argmin(1) for s in range(0, len(z), 32768)])
    cnt = np.bincount(a, minlength=n)
    assert cnt.min() > 0
    cent = np.stack([np.bincount(a, z[:, j].astype(np.float64), minlength=n) / cnt for j in range(2)], 1)
    assert np.abs(cent - pts).max() < 0.015  # seeded sample: measured 0.0069 (values) and 0.0089 (keys)


# --------------------------------------------------------------------------------------------- dispatch


def test_four_setting_takes_the_four_kernel_pipeline_not_the_fused_kernel(monkeypatch) -> None:
    """RQ_ATTN=four on a 'GPU': a decode step goes to qk_dot (a stub that declines, so the reference path finishes
    it), never to attn_fused."""
    from kernel_emu import configure

    import rq_core.kernels.launch as K
    from rq_core.cache.kv_cache import IsoQuantCache

    calls: list[str] = []

    def qk_dot(*a, **k):
        calls.append("qk_dot")
        raise K.KernelUnsupported("stub")

    configure(monkeypatch, attention="four", append="ops")
    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "fused_attention", lambda *a, **k: calls.append("fused") or (None, None))
    monkeypatch.setattr(K, "qk_dot", qk_dot)
    rng = np.random.default_rng(0)
    r = lambda *s: mx.array(rng.standard_normal(s).astype(np.float16))  # noqa: E731
    c = IsoQuantCache(head_dim=128, n_kv_heads=2, layer=1, fp16_window=4, pair_points=(128, 32))
    c.attend(r(1, 8, 40, 128), r(1, 2, 40, 128), r(1, 2, 40, 128), scale=128**-0.5, mask="causal")
    c.end_prefill()
    out = c.attend(r(1, 8, 1, 128), r(1, 2, 1, 128), r(1, 2, 1, 128), scale=128**-0.5)
    assert calls == ["qk_dot"] and np.isfinite(np.array(out.astype(mx.float32))).all()
