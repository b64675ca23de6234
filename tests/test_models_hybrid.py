"""Nemotron-H and Gemma 4 beyond the shared golden tests: Mamba2 state across chunked prefill, the
sliding-window cache wrapping, config parsing of the real releases, routing, weight layouts."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from rq_core.checkpoint import build_model, load_weights
from rq_core.errors import RQError
from rq_core.cache.kv_cache import FP16Cache, KVSettings
from rq_core.models import base, gemma4, nemotron_h, text_config
from rq_core.models.mamba import Mamba2Mixer, MambaCache

GOLDEN = Path(__file__).parent / "golden"


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


# Float32 paths against a float32 reference, max |diff| / max |ref| (this file's tests measured each):
# F32_REL for whole models against transformers' logits: worst measured 3.46e-6 (gemma4; nemotron_h 5.0e-7 to
# 6.1e-7), 3x that for another BLAS summation order. MIXER_REL for one Mamba mixer against the float64 loop:
# measured 2.4e-7, 4x that.
F32_REL = 1e-5
MIXER_REL = 1e-6


def _golden(family: str):
    path = GOLDEN / family / "model"
    config = json.loads((path / "config.json").read_text())
    g = json.loads((GOLDEN / family / "golden.json").read_text())
    ref = np.array(mx.load(str(GOLDEN / family / "golden.safetensors"))["logits"])
    return path, config, g, ref


def _chunked(model, ids: list[int], sizes: list[int], kv: KVSettings = KVSettings()):
    cache = model.make_cache(kv)
    out, i = [], 0
    for n in sizes:
        out.append(np.array(model(mx.array([ids[i:i + n]]), cache=cache)[0].astype(mx.float32)))
        i += n
    assert i == len(ids)
    return np.concatenate(out), cache


# ------------------------------------------------------------------------------------------ Mamba2
def _mixer_reference(m: Mamba2Mixer, h: np.ndarray) -> np.ndarray:
    """The Mamba2 mixer written out token by token in float64 numpy (an independent recurrence)."""
    p = {k: np.array(v, np.float64) for k, v in tree_flatten(m.parameters())}
    I, G, N, H, P, K = m.intermediate_size, m.n_groups, m.state_size, m.num_heads, m.head_dim, m.conv_kernel
    B, L, _ = h.shape
    z = h @ p["in_proj.weight"].T
    gate, xbc, dt = z[..., :I], z[..., I:I + m.conv_dim], z[..., I + m.conv_dim:]
    w = p["conv1d.weight"][:, :, 0]  # [C, K]
    pad = np.concatenate([np.zeros((B, K - 1, m.conv_dim)), xbc], axis=1)
    conv = np.stack([(pad[:, t:t + K] * w.T).sum(1) for t in range(L)], axis=1) + p["conv1d.bias"]
    conv = conv / (1 + np.exp(-conv))
    x, Bm, Cm = conv[..., :I], conv[..., I:I + G * N], conv[..., I + G * N:]
    dt = np.log1p(np.exp(dt + p["dt_bias"]))
    dt = np.maximum(dt, m.dt_min)
    A = -np.exp(p["A_log"])
    y = np.zeros((B, L, H, P))
    for b in range(B):
        s = np.zeros((H, P, N))
        for t in range(L):
            for hh in range(H):
                g = hh // (H // G)
                bv, cv = Bm[b, t, g * N:(g + 1) * N], Cm[b, t, g * N:(g + 1) * N]
                xv = x[b, t, hh * P:(hh + 1) * P]
                s[hh] = s[hh] * np.exp(dt[b, t, hh] * A[hh]) + dt[b, t, hh] * np.outer(xv, bv)
                y[b, t, hh] = s[hh] @ cv + p["D"][hh] * xv
    y = y.reshape(B, L, I) * (gate / (1 + np.exp(-gate)))
    yg = y.reshape(B, L, G, I // G)
    yg = yg / np.sqrt((yg ** 2).mean(-1, keepdims=True) + m.norm.eps)
    y = yg.reshape(B, L, I) * p["norm.weight"]
    return y @ p["out_proj.weight"].T


def _random_mixer(seed: int = 0) -> Mamba2Mixer:
    mx.random.seed(seed)
    m = Mamba2Mixer(16, num_heads=4, head_dim=4, state_size=8, n_groups=2, conv_kernel=4, chunk_size=4,
                    dt_min=0.05)
    rng = np.random.default_rng(seed)
    m.update({"dt_bias": mx.array(rng.uniform(-4, 1, 4), mx.float32),
              "A_log": mx.array(rng.uniform(-1, 1.5, 4), mx.float32),
              "D": mx.array(rng.uniform(0.5, 1.5, 4), mx.float32),
              "norm": {"weight": mx.array(rng.uniform(0.5, 1.5, 16), mx.float32)}})
    return m


def test_mamba_mixer_matches_sequential_reference() -> None:
    m = _random_mixer()
    h = np.random.default_rng(1).standard_normal((2, 11, 16)).astype(np.float32)
    want = _mixer_reference(m, h)
    # One shot: 3 SSD chunks of 4 (the last one short).
    assert _rel(m(mx.array(h)), want) < MIXER_REL
    # Through the state cache, in pieces that straddle chunk boundaries, then token by token (decode path).
    cache = MambaCache()
    parts = [m(mx.array(h[:, a:b]), cache) for a, b in ((0, 3), (3, 9), (9, 10), (10, 11))]
    assert _rel(mx.concatenate(parts, axis=1), want) < MIXER_REL
    assert cache.offset == 11 and cache.ssm_state.dtype == mx.float32
    assert cache.conv_state.shape == (2, 3, m.conv_dim)
    assert cache.nbytes == cache.fp16_nbytes == cache.ssm_state.nbytes + cache.conv_state.nbytes
    assert cache.trim(1) == 0  # a recurrent state cannot roll back


def test_mamba_conv_is_the_depthwise_conv1d_without_the_conv_op(monkeypatch) -> None:
    """Mamba2Mixer._conv computes nn.Conv1d's causal depthwise conv (the same float32 numbers, a prompt and one token
    after a carried window) as shifted multiply-adds: the conv op is never called (on CUDA it chooses a cuDNN engine
    and allocates a workspace at every call)."""
    m = Mamba2Mixer(64, 4, 16, 8, 2, 4)
    m.conv1d.weight = mx.random.normal(m.conv1d.weight.shape, key=mx.random.key(1))
    m.conv1d.bias = mx.random.normal(m.conv1d.bias.shape, key=mx.random.key(2))
    refs = {}
    for L in (1, 9):
        u = mx.random.normal((1, L, m.conv_dim), key=mx.random.key(L))
        prev = mx.random.normal((1, 3, m.conv_dim), key=mx.random.key(10 + L))
        refs[L] = (u, prev, nn.silu(m.conv1d(mx.concatenate([prev, u], axis=1))))
    monkeypatch.setattr(nn.Conv1d, "__call__", lambda *a, **k: pytest.fail("the conv op was called"))
    for L, (u, prev, ref) in refs.items():
        got, carried = m._conv(u, prev)
        assert got.shape == ref.shape and float(mx.abs(got - ref).max()) < 1e-5, L
        assert mx.array_equal(carried, mx.concatenate([prev, u], axis=1)[:, -3:])


def test_a_prompts_mamba_state_holds_only_its_own_memory() -> None:
    """After a prompt chunk the cache holds the conv window (K - 1 rows) and the SSM state, not the chunk's input
    behind them: a slice is a view of its source's buffer, and the window as a view of the padded chunk kept [B,
    chunk + K - 1, conv_dim] alive as every Mamba layer's state until the first decode step (10.5 MB a layer for
    Nemotron 3 Super's 512-token chunks, ~0.4 GB over its 40 Mamba layers, outside the memory plan)."""
    import gc

    m = Mamba2Mixer(64, 8, 16, 8, 2, 4)
    mx.eval(m.parameters())
    cache = MambaCache()
    gc.collect()
    before = mx.get_active_memory()
    h = mx.random.normal((1, 2048, 64), key=mx.random.key(0))
    y = m(h, cache)
    mx.eval(y, cache.conv_state, cache.ssm_state)
    del h, y
    gc.collect()
    held = mx.get_active_memory() - before
    own = cache.conv_state.nbytes + cache.ssm_state.nbytes
    assert held <= own + (64 << 10), (held, own)  # the chunk's padded input: 2,051 x 160 floats, 1.3 MB


def test_mamba_dt_floor_applies_in_prefill_and_decode() -> None:
    m = _random_mixer(2)
    m.update({"dt_bias": mx.full((4,), -9.0)})  # softplus(-9 + small) ≈ 1e-4 < dt_min = 0.05
    h = np.random.default_rng(3).standard_normal((1, 6, 16)).astype(np.float32)
    want = _mixer_reference(m, h)
    cache = MambaCache()
    step = [m(mx.array(h[:, t:t + 1]), cache) for t in range(6)]
    assert _rel(mx.concatenate(step, axis=1), want) < MIXER_REL
    assert _rel(m(mx.array(h)), want) < MIXER_REL


def test_nemotron_chunked_prefill_equals_one_shot() -> None:
    path, config, g, ref = _golden("nemotron_h")
    model = build_model(config, load_weights(path))
    ids = g["prompt_ids"]
    for sizes in ([1, 7, 3, 13, 8], [32], [9] * 3 + [5], [1] * 32):
        out, cache = _chunked(model, ids, sizes)
        assert _rel(out, ref) < F32_REL, sizes
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["MambaCache", "FP16Cache", "NoCache", "NoCache"]
    assert all(c.offset == len(ids) for c in cache)


def test_nemotron_bf16_keeps_ssm_state_float32() -> None:
    path, config, g, ref = _golden("nemotron_h")
    keep = ("A_log", "e_score_correction_bias")  # fp32 in the released bf16 checkpoints too
    weights = {k: v if k.endswith(keep) else v.astype(mx.bfloat16) for k, v in load_weights(path).items()}
    model = build_model(config, weights)
    out, cache = _chunked(model, g["prompt_ids"], [20, 12])
    assert cache[0].ssm_state.dtype == mx.float32 and cache[0].conv_state.dtype == mx.bfloat16
    assert cache[1].keys.dtype == mx.bfloat16  # activations stay bf16 outside the SSM
    # bf16 weights and activations (eps 2^-8 = 0.0039): measured 0.0121, the bound 2x that
    assert _rel(out, ref) < 0.025
    assert (out.argmax(-1) == ref.argmax(-1)).mean() == 1.0  # measured: every position's top token kept


def test_nemotron_weight_layouts() -> None:
    """transformers 5 in-memory names (`model.`, stacked experts) and mlx-lm's (`switch_mlp.fc1/fc2`) load too."""
    path, config, g, ref = _golden("nemotron_h")
    weights = load_weights(path)
    x = mx.array([g["prompt_ids"]])
    t5 = {}
    for k, v in weights.items():
        t5["model." + k[len("backbone."):] if k.startswith("backbone.") else k] = v
    E = config["n_routed_experts"]
    for n in ("up_proj", "down_proj"):
        t5[f"model.layers.2.mixer.experts.{n}"] = mx.stack(
            [t5.pop(f"model.layers.2.mixer.experts.{e}.{n}.weight") for e in range(E)])
    t5["mtp.layers.0.norm.weight"] = mx.zeros((4,))  # multi-token-prediction weights are dropped
    assert _rel(build_model(config, t5)(x)[0], ref) < F32_REL
    ours = dict(tree_flatten(build_model(config, weights).parameters()))
    assert "backbone.layers.2.mixer.switch_mlp.up_proj.weight" in ours
    assert ours["backbone.layers.0.mixer.conv1d.weight"].shape[-1] == 1
    mlxlm = {k.replace("switch_mlp.up_proj", "switch_mlp.fc1").replace("switch_mlp.down_proj", "switch_mlp.fc2"): v
             for k, v in ours.items()}
    assert _rel(build_model(config, mlxlm)(x)[0], ref) < F32_REL


SUPER_120B = {  # the parts of nvidia/NVIDIA-Nemotron-3-Super-120B-A12B's config.json that shape the model
    "model_type": "nemotron_h", "hidden_size": 4096, "vocab_size": 131072, "head_dim": 128,
    "hybrid_override_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32, "num_key_value_heads": 2, "mamba_num_heads": 128, "mamba_head_dim": 64,
    "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128, "n_routed_experts": 512,
    "num_experts_per_tok": 22, "moe_intermediate_size": 2688, "moe_latent_size": 1024,
    "moe_shared_expert_intermediate_size": 5376, "routed_scaling_factor": 5.0, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "mlp_hidden_act": "relu2", "time_step_min": 0.001, "num_hidden_layers": 88,
    "mtp_hybrid_override_pattern": "*E", "num_nextn_predict_layers": 1,
}


def test_nemotron_args_from_real_and_legacy_configs() -> None:
    a = nemotron_h.ModelArgs.from_dict(SUPER_120B)
    assert a.num_hidden_layers == 88 and a.pattern.count("*") == 8 and a.pattern.count("M") == 40
    assert a.pattern.count("E") == 40 and a.moe_latent_size == 1024
    names = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
    b = nemotron_h.ModelArgs.from_dict({**{k: v for k, v in SUPER_120B.items() if k != "hybrid_override_pattern"},
                                        "layers_block_type": [names[c] for c in a.pattern]})
    assert b.pattern == a.pattern
    legacy = nemotron_h.ModelArgs.from_dict({"hybrid_override_pattern": "M-", "mamba_n_groups": 4,
                                             "mamba_d_conv": 3, "mamba_chunk_size": 64})
    assert (legacy.n_groups, legacy.conv_kernel, legacy.chunk_size) == (4, 3, 64)
    with pytest.raises(RQError, match="pattern"):
        nemotron_h.ModelArgs.from_dict({"hybrid_override_pattern": "M*X"})
    with pytest.raises(RQError, match="layer types"):
        nemotron_h.ModelArgs.from_dict({"layers_block_type": ["mamba", "cross_attention"]})
    with pytest.raises(RQError, match="hybrid_override_pattern"):
        nemotron_h.ModelArgs.from_dict({"hidden_size": 8})


def _routing_reference(logits, bias, k, n_group, topk_group, norm, scale):
    """transformers' NemotronHTopkRouter in numpy (masked groups at -inf)."""
    s = 1 / (1 + np.exp(-logits))
    choice = s + bias
    T, E = s.shape
    g = choice.reshape(T, n_group, E // n_group)
    gs = np.sort(g, -1)[..., -2:].sum(-1)
    keep = np.argsort(-gs, -1)[:, :topk_group]
    mask = np.zeros((T, n_group), bool)
    np.put_along_axis(mask, keep, True, -1)
    choice = np.where(np.repeat(mask, E // n_group, -1), choice, -np.inf)
    idx = np.argsort(-choice, -1)[:, :k]
    w = np.take_along_axis(s, idx, -1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx, w * scale


@pytest.mark.parametrize("k,n_group,topk_group,norm", [(2, 4, 2, True), (1, 2, 1, True), (3, 4, 1, False)])
def test_sigmoid_group_routing_with_negative_bias(k, n_group, topk_group, norm) -> None:
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((16, 8)).astype(np.float32)
    bias = (rng.standard_normal(8) - 1.5).astype(np.float32)  # chosen scores < 0: dropped groups must lose
    want_i, want_w = _routing_reference(logits, bias, k, n_group, topk_group, norm, 2.5)
    inds, w = base.route_sigmoid_group_topk(mx.array(logits), k, correction_bias=mx.array(bias), n_group=n_group,
                                            topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    order = np.argsort(np.array(inds), -1)
    got_i, got_w = np.take_along_axis(np.array(inds), order, -1), np.take_along_axis(np.array(w), order, -1)
    o2 = np.argsort(want_i, -1)
    assert (got_i == np.take_along_axis(want_i, o2, -1)).all()
    assert np.allclose(got_w, np.take_along_axis(want_w, o2, -1), atol=1e-6)  # measured 2.4e-7 (1 ulp at 2.4)


# ------------------------------------------------------------------------------------------ Gemma 4
@pytest.mark.parametrize("sizes", [[3] * 7 + [2], [1] * 23, [7, 1, 1, 1, 9, 1, 1, 2], [2, 1, 1, 19], [23]])
def test_sliding_window_cache_any_chunking_matches_direct_attention(sizes: list[int]) -> None:
    mx.random.seed(1)
    B, H, L, D, W = 1, 2, 23, 16, 5
    q, k, v = (mx.random.normal((B, H, L, D)) for _ in range(3))
    want = np.array(base.attend(None, q, k, v, scale=0.25, window=W))
    c, parts, i = base.SlidingWindowCache(W), [], 0
    for n in sizes:
        s = slice(i, i + n)
        parts.append(np.array(c.attend(q[:, :, s], k[:, :, s], v[:, :, s], scale=0.25, mask=base.attention_mask(n))))
        i += n
    assert np.allclose(np.concatenate(parts, axis=2), want, atol=1e-6)  # measured 2.4e-7 (values up to 2.6)
    assert c.offset == L and c.valid == W and c.keys.shape[2] == W
    assert c.nbytes == c.fp16_nbytes * 2  # float32 here; fp16_nbytes counts 2 bytes a value
    assert c.fp16_nbytes == 2 * B * H * W * 2 * D


def test_sliding_window_cache_trim() -> None:
    mx.random.seed(2)
    B, H, L, D, W = 1, 1, 20, 8, 5
    q, k, v = (mx.random.normal((B, H, L, D)) for _ in range(3))
    want = np.array(base.attend(None, q, k, v, scale=0.3, window=W))
    for n0, ask, got in ((15, 3, 1), (4, 3, 3)):  # after eviction only 1 token can go; before, any
        c = base.SlidingWindowCache(W)
        c.attend(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], scale=0.3, mask="causal")
        assert c.trim(ask) == got and c.offset == n0 - got
        o = c.offset
        outs = [np.array(c.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], scale=0.3))
                for t in range(o, o + 4)]
        assert np.allclose(np.concatenate(outs, axis=2), want[:, :, o:o + 4], atol=1e-6)  # measured 6e-8


def test_gemma4_sliding_cache_wraps() -> None:
    path, config, g, ref = _golden("gemma4")
    model = build_model(config, load_weights(path))
    window = config["text_config"]["sliding_window"]
    ids = g["prompt_ids"]
    assert window < len(ids)
    for sizes in ([3, 8, 1, 20], [1] * 32, [window + 5, 32 - window - 5]):
        out, cache = _chunked(model, ids, sizes)
        assert _rel(out, ref) < F32_REL, sizes
    for i, c in enumerate(cache):
        if model.layers[i].self_attn.is_sliding:
            assert isinstance(c, base.SlidingWindowCache) and c.valid == window and c.keys.shape[2] == window
        else:
            assert isinstance(c, FP16Cache) and c.offset == len(ids)
    # Decoding on past the window keeps matching a full recompute.
    out, cache = _chunked(model, ids, [32])
    seq, steps = list(ids) + [int(out[-1].argmax())], []
    for _ in range(6):
        steps.append(np.array(model(mx.array([[seq[-1]]]), cache=cache)[0, -1]))
        seq.append(int(steps[-1].argmax()))
    full = np.array(model(mx.array([seq[:-1]]))[0])
    assert _rel(np.stack(steps), full[32:]) < F32_REL


def test_gemma4_text_only_layout_matches_multimodal() -> None:
    """The same weights as a text-only `gemma4_text` checkpoint (transformers' Gemma4ForCausalLM names)."""
    path, config, g, ref = _golden("gemma4")
    weights = load_weights(path)
    text = {"model." + k[len("model.language_model."):]: v for k, v in weights.items()
            if k.startswith("model.language_model.")}
    assert len(text) < len(weights)  # the vision tower is gone
    tcfg = dict(config["text_config"], model_type="gemma4_text")
    m = build_model(tcfg, text)
    assert not m.args.multimodal and "model" in m
    assert _rel(m(mx.array([g["prompt_ids"]]))[0], ref) < F32_REL
    mm = build_model(config, weights)
    ours = dict(tree_flatten(mm.parameters()))
    assert "language_model.model.layers.0.experts.switch_glu.gate_proj.weight" in ours  # mlx-lm's names
    assert not any("vision" in k for k in ours)
    assert _rel(build_model(config, ours)(mx.array([g["prompt_ids"]]))[0], ref) < F32_REL


GEMMA4_26B_TEXT = {  # text_config of google/gemma-4-26B-A4B (the parts that shape the model)
    "model_type": "gemma4_text", "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
    "num_global_key_value_heads": 2, "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 128,
    "top_k_experts": 8, "moe_intermediate_size": 704, "hidden_size_per_layer_input": 0, "sliding_window": 1024,
    "final_logit_softcapping": 30.0, "num_kv_shared_layers": 0, "use_bidirectional_attention": "vision",
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5, "vocab_size": 262144,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
}


def test_gemma4_args_from_real_config() -> None:
    a = gemma4.ModelArgs.from_dict({"model_type": "gemma4", "text_config": GEMMA4_26B_TEXT,
                                    "vision_config": {"hidden_size": 1152}, "tie_word_embeddings": True})
    assert a.multimodal and a.tie_word_embeddings
    full = [i for i, t in enumerate(a.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23, 29]
    assert [a.layer_head_dim[i] for i in (0, 5)] == [256, 512]
    assert [a.layer_kv_heads[i] for i in (0, 5)] == [8, 2]
    # Without K = V the global kv-head override does not apply (transformers' rule); global head dim
    # defaults to 512; the last layer is forced to full attention.
    b = gemma4.ModelArgs.from_dict({"layer_types": ["sliding_attention"] * 3, "attention_k_eq_v": False,
                                    "num_global_key_value_heads": 1, "num_key_value_heads": 4, "head_dim": 64,
                                    "num_hidden_layers": 3})
    assert b.layer_types[-1] == "full_attention" and b.layer_head_dim == [64, 64, 512]
    assert b.layer_kv_heads == [4, 4, 4]
    # KV sharing (E2B-like): the last 20 layers reuse the last earlier layer of their type.
    e = gemma4.ModelArgs.from_dict({**GEMMA4_26B_TEXT, "num_kv_shared_layers": 20})
    assert e.kv_source[:10] == [None] * 10 and e.kv_source[10] == 9 and e.kv_source[11] == 5
    assert set(e.kv_source[10:]) == {9, 5}
    with pytest.raises(RQError, match="shares K/V"):
        gemma4.ModelArgs.from_dict({"num_hidden_layers": 3, "num_kv_shared_layers": 2,
                                    "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    with pytest.raises(RQError, match="non-causal"):
        gemma4.ModelArgs.from_dict({**GEMMA4_26B_TEXT, "use_bidirectional_attention": "all"})


def test_text_config_nested_keys_win_outer_keys_fill_in() -> None:
    flat = {"model_type": "qwen3_moe", "vocab_size": 8}
    assert text_config(flat) is flat
    nested = {"model_type": "gemma4", "tie_word_embeddings": False, "vocab_size": 1,
              "text_config": {"model_type": "gemma4_text", "vocab_size": 320}}
    tc = text_config(nested)
    assert (tc["model_type"], tc["vocab_size"], tc["tie_word_embeddings"]) == ("gemma4_text", 320, False)
    # The model keeps the release's model_type (its tensor names follow it) and the outer tie setting.
    a = gemma4.ModelArgs.from_dict({**nested, "text_config": dict(GEMMA4_26B_TEXT)})
    assert (a.model_type, a.multimodal, a.tie_word_embeddings, a.vocab_size) == ("gemma4", True, False, 262144)


def test_gemma4_isoquant_caches_only_full_layers() -> None:
    path, config, g, _ = _golden("gemma4")
    model = build_model(config, load_weights(path))
    cache = model.make_cache(KVSettings(mode="isoquant3"))
    for layer, c in zip(model.layers, cache):
        if layer.self_attn.is_sliding:
            assert isinstance(c, base.SlidingWindowCache)
        else:
            assert type(c).__name__ == "IsoQuantCache" and layer.self_attn.head_dim == 128


@pytest.mark.parametrize("family", ["nemotron_h", "gemma4"])
def test_quantized_checkpoint_roundtrip(family: str, tmp_path: Path) -> None:
    """mlx-lm style quantized checkpoint (per-path `quantization` entries) of the hybrid families loads back."""
    import shutil

    from rq_core.checkpoint import load

    path, config, g, ref = _golden(family)
    model = build_model(config, load_weights(path))
    gs = 32

    def pred(p: str, m: nn.Module):
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % gs == 0

    nn.quantize(model, group_size=gs, bits=8, class_predicate=pred)  # 8 bits: close enough to bound
    qcfg: dict = {"group_size": gs, "bits": 8}
    n_q = 0
    for name, m in model.named_modules():
        if hasattr(m, "scales"):
            n_q += 1
        elif hasattr(m, "to_quantized") and hasattr(m, "weight"):
            qcfg[name] = False
    assert n_q
    if family == "gemma4":  # (the tiny Nemotron's expert dims, 16, are below the group size)
        assert any(type(m).__name__ == "QuantizedSwitchLinear" for _, m in model.named_modules())
    out = tmp_path / "q"
    shutil.copytree(path, out)
    (out / "model.safetensors").unlink()
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps({**config, "quantization": qcfg}))
    loaded = load(out, tokenizer=False).model
    x = mx.array([g["prompt_ids"]])
    want, got = np.array(model(x)[0]), np.array(loaded(x)[0])
    assert _rel(got, want) == 0.0  # the same weights through the same ops: measured bit-identical
    # the quantized tiny model against its float logits: deterministic, so pinned to what was measured, to 1e-4
    # relative (F32_REL's summation-order room moves this ratio by at most ~3e-5 of itself)
    assert _rel(got, ref) == pytest.approx({"nemotron_h": 0.0162515, "gemma4": 0.183112}[family], rel=1e-4)


def test_gemma4_kv_sharing_layers() -> None:
    """gemma4_text golden: layers 2 and 3 reuse layers 0 and 1's K/V; their own k/v weights are ignored."""
    path, config, g, ref = _golden("gemma4_text")
    weights = load_weights(path)
    model = build_model(config, weights)
    assert model.args.kv_source == [None, None, 0, 1]
    assert [l.self_attn.shared for l in model.layers] == [False, False, True, True]
    assert "k_proj" not in model.layers[2].self_attn and model.layers[3].mlp.up_proj.weight.shape[0] == 64
    extra = dict(weights)
    extra["model.layers.2.self_attn.k_proj.weight"] = mx.zeros((32, 32))  # as some exports carry them
    extra["model.layers.3.self_attn.k_norm.weight"] = mx.zeros((128,))
    assert _rel(build_model(config, extra)(mx.array([g["prompt_ids"]]))[0], ref) < F32_REL
    out, cache = _chunked(model, g["prompt_ids"], [5, 11, 1, 15], KVSettings(mode="isoquant3"))
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["SlidingWindowCache", "IsoQuantCache", "SlidingWindowCache", "IsoQuantCache"]
    assert (out.argmax(-1) == ref.argmax(-1)).mean() == 1.0  # measured: every position's top token kept


@pytest.mark.parametrize("family,layers", [("qwen3_moe", 5), ("qwen2_moe", 4), ("nemotron_h", None), ("gemma4", None)])
def test_every_family_gives_its_edge_layers_their_bits(family, layers) -> None:
    """Each model's make_cache ends with with_edge_layers: the first and last compressed caches are scalar 4-bit
    (kv.edge_layers), the others the mode's own; sliding-window and Mamba layers are not counted."""
    import copy

    from tests._tiny_models import TINY
    from rq_core.cache.kv_cache import IsoQuantCache

    cfg = copy.deepcopy(TINY[family])
    if layers:
        cfg["num_hidden_layers"] = layers
    if family == "nemotron_h":
        cfg["hybrid_override_pattern"] = "M*E*M*E-"
        cfg["num_hidden_layers"] = 8
    if family == "gemma4":
        tc = cfg["text_config"]
        tc["layer_types"] = ["sliding_attention", "full_attention", "full_attention", "sliding_attention",
                             "full_attention"]
        tc["num_hidden_layers"] = 5
    model = build_model(cfg)
    kv = KVSettings(mode="isoquant3", edge_layers=1)
    caches = model.make_cache(kv)
    comp = [i for i, c in enumerate(caches) if isinstance(c, IsoQuantCache)]
    assert len(comp) >= 3
    for i in comp:
        c = caches[i]
        edge = i in (comp[0], comp[-1])
        assert (c.bits == 4 and c.pair_points is None) == edge, (family, i, c.bits, c.pair_points)
    plain = model.make_cache(KVSettings(mode="isoquant3"))
    assert all(plain[i].bits != 4 for i in comp)
