"""Every model family's real attention shape takes the fused kernel on a GPU: the dispatcher's decision
(rq_core.attention.dispatch.fused_declines, the launch plan `attend` uses) asked of the shapes in tests/data/configs/
for the CUDA and Metal backends, with the codebooks a compressed cache takes there (isoquant3's pair codebooks, the edge
layers' 4-bit scalar codes, 3-bit scalar codes, 4-bit keys with 3-bit values). No GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from rq_core.attention import dispatch
from rq_core.cache.kv_cache import KVSettings, make_kv_cache
from rq_core.models import gemma4, nemotron_h, qwen3_moe

CONFIGS = Path(__file__).parent / "data" / "configs"


def _layer_shapes() -> dict[str, set[tuple[int, int, int]]]:
    """{config: {(head_dim, query heads, kv heads)}} of its attention layers, as the model code resolves them."""
    out = {}
    for f, mod in (("qwen3-30b-a3b.json", qwen3_moe), ("nemotron3-nano-30b-a3b.json", nemotron_h),
                   ("nemotron3-super-120b-a12b.json", nemotron_h), ("gemma4-26b-a4b.json", gemma4)):
        a = mod.ModelArgs.from_dict(json.loads((CONFIGS / f).read_text()))
        dims = getattr(a, "layer_head_dim", None) or [a.head_dim]
        kvs = getattr(a, "layer_kv_heads", None) or [a.num_key_value_heads]
        out[f] = {(d, a.num_attention_heads, k) for d, k in zip(dims, kvs)}
    # Qwen2-MoE (no config in the data): Qwen2-57B-A14B's 28 / 4 heads, Qwen1.5-MoE-A2.7B's 16 / 16, head_dim 128
    out["qwen2_moe"] = {(128, 28, 4), (128, 16, 16)}
    return out


SHAPES = _layer_shapes()
ISO = KVSettings(mode="isoquant3")


def _codebooks(d: int) -> list[dict]:
    """The codebooks of a compressed layer at head dim d: the default's, the edge layers', and two scalar ones."""
    pairs = ISO.pairs_for(d)
    edge = ISO.edge_settings()
    return [dict(bits=3, pair_points=pairs), dict(bits=edge.bits), dict(bits=3), dict(bits=3, key_bits=4)]


def test_the_shapes_are_the_real_ones():
    # what the kernel must cover: R = 8 (Qwen3), 16 (Nemotron 3), Gemma 4's sliding 256 and global 512 head dims
    assert SHAPES["qwen3-30b-a3b.json"] == {(128, 32, 4)}
    assert SHAPES["nemotron3-nano-30b-a3b.json"] == SHAPES["nemotron3-super-120b-a12b.json"] == {(128, 32, 2)}
    assert SHAPES["gemma4-26b-a4b.json"] == {(256, 16, 8), (512, 16, 2)}
    assert ISO.pairs_for(128) == ISO.pairs_for(512) == (128, 32)


def _params():
    for family in sorted(SHAPES):
        for shape in sorted(SHAPES[family]):
            yield pytest.param(family, shape, id=f"{family}-{shape[0]}-{shape[1]}-{shape[2]}")


@pytest.mark.parametrize("backend", ["cuda", "metal"])
@pytest.mark.parametrize("family,shape", list(_params()))
def test_every_family_shape_takes_the_fused_kernel(backend, family, shape):
    d, hq, hkv = shape
    declined = []
    for cb in _codebooks(d):
        for window in (True, False):
            why = dispatch.fused_declines(backend, head_dim=d, q_heads=hq, kv_heads=hkv, window=window, **cb)
            if why is not None:
                declined.append(f"head_dim {d}, {hq}/{hkv} heads, {cb}, window {window}: {why}")
    assert not declined, "\n".join(declined)


def test_decision_declines_what_the_kernel_does_not_cover():
    # the decision can fail: head dims, query rows and code widths outside the kernel are named
    assert "head_dim 96" in dispatch.fused_declines("cuda", head_dim=96, q_heads=8, kv_heads=1, bits=3)
    assert "rows" in dispatch.fused_declines("cuda", head_dim=128, q_heads=8, kv_heads=1, bits=3, L=9)
    assert dispatch.fused_declines("metal", head_dim=128, q_heads=8, kv_heads=1, bits=5) is not None
    assert dispatch.fused_declines("cuda", head_dim=128, q_heads=64, kv_heads=1, bits=3) is None


@pytest.mark.parametrize("d,cb", [(128, dict(bits=3, pair_points=(128, 32))), (512, dict(bits=3, pair_points=(128, 32))),
                                  (128, dict(bits=4)), (256, dict(bits=3, key_bits=4))])
def test_decision_shapes_are_the_caches(d, cb, monkeypatch):
    """The shapes fused_declines plans with are those a real cache of these settings holds (code row words, codebook
    tables): so the decision is the one `attend` makes for that cache."""
    from rq_core.kernels import launch as kernels

    seen = {}

    def spy(be, qshape, qdtype, kshape, vshape, lvshape, klvshape, bits, key_bits, **kw):
        seen.update(k=kshape[3], v=vshape[3], lv=lvshape, klv=klvshape, bits=bits, key_bits=key_bits)
        return None

    monkeypatch.setattr(kernels, "fused_plan_declines", spy)
    dispatch.fused_declines("cuda", head_dim=d, q_heads=4, kv_heads=2, **cb)
    s = KVSettings(mode="isoquant3", bits=cb["bits"], key_bits=cb.get("key_bits"), pair_points=cb.get("pair_points", ()))
    c = make_kv_cache(s, layer=0, n_kv_heads=2, head_dim=d)
    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 8, d)).astype(np.float16))
    c.attend(x, x, x, scale=d ** -0.5)
    c.end_prefill()
    assert c.k_codes is not None and (seen["k"], seen["v"]) == (c.k_codes.shape[3], c.v_codes.shape[3])
    assert seen["lv"] == tuple(c.levels.shape)
    own = c.key_bits is not None
    assert seen["klv"] == (tuple(c.k_levels.shape) if own else None)
    assert (seen["bits"], seen["key_bits"]) == (c.bits, c.key_bits if own else None)
