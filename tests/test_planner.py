"""The planner: shapes from the lazy model agree with real tensors; budgets decide the slots."""

import json
from pathlib import Path

import pytest

from _tiny_models import TINY, available
from rq_core.quant import recipe
from rq_core.paging.planner import kv_bytes, param_shapes, plan, tensor_bytes
from rq_core.quant.recipe import RoleSpec

CONFIGS = Path(__file__).parent / "data" / "configs"


def _cfg(name):
    return json.loads((CONFIGS / name).read_text())


def test_tensor_bytes_matches_mx_quantize():
    import mlx.core as mx

    w = mx.zeros((64, 256), mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=2)
    assert tensor_bytes((64, 256), RoleSpec(2, 64)) == q.nbytes + s.nbytes + b.nbytes
    assert tensor_bytes((64,), RoleSpec(2, 64)) == 128  # vectors are never quantized


def test_qwen3_real_config_plan(monkeypatch):
    cfg = _cfg("qwen3-30b-a3b.json")
    p = plan(cfg, recipe.load("qwen3-16gb"))
    assert p.moe_layers == 48 and p.experts_per_layer == 128 and p.top_k == 8
    # parameter count of Qwen3-30B-A3B from its config: exactly the model card's 30,532,122,624
    assert sum(p.role_params.values()) == 30_532_122_624
    # per expert: 3 projections of 768x2048 at 2 bits, group 64 (bf16 scale+bias)
    assert p.bytes_per_expert == 3 * (768 * 2048 // 4 + 768 * 2048 // 64 * 4)
    # isoquant3: 12 words + fp16 norm per vector; the first and last layers (kv.edge_layers 1) 16 words
    assert p.kv_bytes_per_token == 46 * 2 * 4 * (12 * 4 + 2) + 2 * 2 * 4 * (16 * 4 + 2)
    assert p.fits and p.budget_bytes == 16 * 10**9
    # the prompt's fp16 K/V while it is prefilled, counted in the peak: by default kv.prefill_fp16's 4,096 tokens (the
    # recipe's context is 8,192) and two layers' decoded context; "all" (None) the whole prompt; an fp16 cache has no
    # such extra (its K/V is the KV line)
    fp16_tok = 48 * 2 * 4 * 128 * 2
    assert p.prefill_fp16_bytes == fp16_tok * 4096 + 2 * (fp16_tok // 48) * 8192
    assert p.planned_peak_bytes >= p.kv_bytes + p.prefill_fp16_bytes
    rec = recipe.load("qwen3-16gb")
    rec.kv.prefill_fp16 = None
    assert plan(cfg, rec).prefill_fp16_bytes == fp16_tok * 8192
    rec.kv.prefill_fp16 = 2000
    # rounded up as the caches grow; plus two layers' K/V of the whole context, decoded as each chunk attends to it
    assert plan(cfg, rec).prefill_fp16_bytes == fp16_tok * 2048 + 2 * (fp16_tok // 48) * 8192
    assert plan(cfg, rec, context=1000).prefill_fp16_bytes == fp16_tok * 1024  # never more than the context
    rec.kv.mode = "fp16"
    assert plan(cfg, rec).prefill_fp16_bytes == 0
    # at a long context the bound counts far less (its two layers' decoded context included)
    rec = recipe.load("qwen3-16gb")
    rec.kv.prefill_fp16 = None
    assert plan(cfg, rec, context=32768).prefill_fp16_bytes == fp16_tok * 32768
    rec.kv.prefill_fp16 = 4096
    assert plan(cfg, rec, context=32768).prefill_fp16_bytes == fp16_tok * 4096 + 2 * (fp16_tok // 48) * 32768
    # two layers' decoded context: the one waited for and IsoQuantCache.prefill_inflight (1) queued ahead; one with 0
    from rq_core.cache.kv_cache import IsoQuantCache

    monkeypatch.setattr(IsoQuantCache, "prefill_inflight", 0)
    assert plan(cfg, rec, context=32768).prefill_fp16_bytes == fp16_tok * 4096 + fp16_tok // 48 * 32768


def test_budget_decides_slots():
    cfg = _cfg("nemotron3-super-120b-a12b.json")
    r = recipe.load("nemotron-32gb")
    full = plan(cfg, r, budget=None)
    assert full.moe_layers == 40 and full.experts_per_layer == 512 and full.top_k == 22
    assert sum(full.role_params.values()) == 120_668_707_840  # counted from the config (measured)
    p32 = plan(cfg, r, budget=32 * 10**9)
    assert p32.top_k <= p32.slots_per_layer < 512 and p32.fits
    assert p32.planned_peak_bytes <= 32 * 10**9  # no slack: measured 0.99988 of the budget (367 slots)
    p8 = plan(cfg, r, budget=8 * 10**9)
    assert not p8.fits and p8.notes


def test_gemma4_kv_counts_only_global_layers_per_token():
    cfg = _cfg("gemma4-26b-a4b.json")
    per_tok, fixed = kv_bytes(cfg, "fp16")
    assert per_tok == 5 * 2 * 2 * 512 * 2  # 5 full layers, 2 global kv heads, head_dim 512
    assert fixed == 25 * 1024 * 2 * 8 * 2 * 256  # 25 sliding layers at a 1024 window


def test_edge_layers_count_their_own_bits():
    """kv.edge_layers: the first and last full-attention layers at edge_bits, the rest at kv_bits; sliding layers are
    not counted (gemma4: 5 full layers of 2 global kv heads at head dim 512)."""
    cfg = _cfg("gemma4-26b-a4b.json")
    base, fixed = kv_bytes(cfg, "isoquant3", 3)
    one, fixed1 = kv_bytes(cfg, "isoquant3", 3, edge_layers=1)
    vec3, vec4 = 512 * 3 // 32 * 4 + 2, 512 * 4 // 32 * 4 + 2
    assert base == 5 * 2 * 2 * vec3 and fixed1 == fixed
    assert one - base == 2 * 2 * 2 * (vec4 - vec3)  # two layers, K and V, two kv heads
    assert kv_bytes(cfg, "isoquant3", 3, edge_layers=3)[0] == 5 * 2 * 2 * vec4  # every layer is an edge
    assert kv_bytes(cfg, "fp16", 3, edge_layers=1)[0] == kv_bytes(cfg, "fp16")[0]


@pytest.mark.parametrize("family", list(TINY))
def test_plan_bytes_match_a_real_quantized_checkpoint(family, tmp_path):
    if not available(family):
        pytest.skip(f"model family {family} not in this build yet")
    from _tiny_models import make_tiny
    from rq_core.quant.quantize import quantize

    r = recipe.load(Path(__file__).parent / "data" / "tiny-rtn.toml")
    src = make_tiny(family, tmp_path / "src")
    res = quantize(src, r, tmp_path / "q")
    p = plan(TINY[family], r)
    assert p.total_bytes == res.bytes_out
    assert set(param_shapes(TINY[family])) >= {k for k in param_shapes(TINY[family]) if "switch" in k}


def test_a_gpu_prompt_without_a_pager_counts_one_dequantized_bank(monkeypatch):
    """models.base.SwitchGLU.dense_prompt: on an NVIDIA GPU, with no pager, a prompt chunk's experts run through each
    bank dequantized whole (one at a time): the plan's activation reserve holds the largest bank in bf16."""
    import mlx.core as mx

    from rq_core.paging.planner import activation_bytes

    cfg = _cfg("qwen3-30b-a3b.json")
    rec = recipe.load("qwen3-16gb")
    rec.pager.memory_budget = None
    cpu = plan(cfg, rec)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    gpu = plan(cfg, rec)
    assert gpu.activation_bytes - cpu.activation_bytes == 128 * 768 * 2048 * 2
    assert plan(cfg, rec, prefill_chunk=64).activation_bytes == activation_bytes(cfg, 64)  # 512 rows: gather_qmm
    assert plan(cfg, rec, budget=16 * 10**9).activation_bytes == cpu.activation_bytes  # a pager's slot banks: no


@pytest.mark.parametrize("head_dim", [16, 32, 64])
def test_kv_bytes_per_token_is_what_compressed_caches_hold(head_dim):
    """kv_bytes' per-token count equals the bytes compressed caches hold per token, at every width: a row's codes
    take whole uint32 words, so 16 coordinates at 1 or 3 bits take 1 and 2 words, not 0.5 and 1.5."""
    import mlx.core as mx

    from rq_core.cache.kv_cache import KVSettings, make_kv_cache

    cfg = dict(TINY["qwen3_moe"], head_dim=head_dim, num_key_value_heads=2, num_attention_heads=4)
    T = 5
    for bits in (1, 2, 3, 4):
        held = 0
        for layer in range(cfg["num_hidden_layers"]):
            c = make_kv_cache(KVSettings(mode="isoquant3", bits=bits), layer=layer, n_kv_heads=2, head_dim=head_dim)
            q = mx.random.normal((1, 4, T, head_dim), key=mx.random.key(layer))
            k, v = (mx.random.normal((1, 2, T, head_dim), key=mx.random.key(10 + i + layer)) for i in range(2))
            c.attend(q, k, v, scale=head_dim ** -0.5, mask="causal")
            c.end_prefill()
            assert c.packed_len == T
            held += c.nbytes
        assert kv_bytes(cfg, "isoquant3", bits) == (held // T, 0), (head_dim, bits)


def test_a_budget_of_exactly_top_k_slots_fits():
    """The least budget that holds top-k slots a layer gives exactly top-k slots, and the plan fits; a byte less
    gives one slot fewer, and it does not."""
    cfg = _cfg("nemotron3-super-120b-a12b.json")
    r = recipe.load("nemotron-32gb")
    p = plan(cfg, r, budget=32 * 10**9)  # the parts below do not depend on the budget
    need = (p.resident_bytes + p.kv_bytes + p.prefill_fp16_bytes + p.activation_bytes
            + p.top_k * p.moe_layers * p.bytes_per_expert)
    at = plan(cfg, r, budget=need)
    assert at.slots_per_layer == at.top_k == 22 and at.fits and at.planned_peak_bytes == need and not at.notes
    below = plan(cfg, r, budget=need - 1)
    assert below.slots_per_layer == 21 and not below.fits and below.notes


def test_a_prompt_chunk_longer_than_prefill_fp16_is_counted_whole():
    """kv.prefill_fp16 below the prefill chunk: a chunk's own tokens stay fp16 while it attends to itself
    (IsoQuantCache keeps max(chunk, prefill_fp16)), so the plan counts a chunk's K/V, rounded up as the caches grow,
    plus two layers' decoded context."""
    cfg = _cfg("qwen3-30b-a3b.json")
    rec = recipe.load("qwen3-16gb")  # context 8,192
    fp16_tok = 48 * 2 * 4 * 128 * 2
    rec.kv.prefill_fp16 = 100
    assert plan(cfg, rec, prefill_chunk=512).prefill_fp16_bytes == fp16_tok * 512 + 2 * (fp16_tok // 48) * 8192
    assert plan(cfg, rec, prefill_chunk=300).prefill_fp16_bytes == fp16_tok * 512 + 2 * (fp16_tok // 48) * 8192
    assert plan(cfg, rec, prefill_chunk=64).prefill_fp16_bytes == fp16_tok * 256 + 2 * (fp16_tok // 48) * 8192
