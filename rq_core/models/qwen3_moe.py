"""Qwen3-MoE (`qwen3_moe`): routed experts only (no shared expert), per-head q/k RMSNorm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from rq_core.errors import RQError
from rq_core.kv_cache import KVSettings, make_kv_cache, with_edge_layers
from rq_core.models.base import (BaseModelArgs, SlidingWindowCache, SwitchGLU, attend, combine_experts,
                                 make_rope, rope_params, route_softmax_topk, stack_experts)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "qwen3_moe"
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    intermediate_size: int = 6144
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    norm_topk_prob: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    vocab_size: int = 151936
    max_position_embeddings: int = 32768
    rope_theta: Optional[float] = None
    rope_scaling: Optional[dict] = None
    rope_parameters: Optional[dict] = None
    use_sliding_window: bool = False
    sliding_window: Optional[int] = None
    max_window_layers: int = 28
    layer_types: Optional[list] = None
    tie_word_embeddings: bool = False
    num_local_experts: Optional[int] = None  # transformers 5 may write num_experts under this name

    def __post_init__(self) -> None:
        if self.num_local_experts is not None:
            self.num_experts = self.num_local_experts
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            # transformers' Qwen3-MoE applies the window to every layer when enabled.
            self.layer_types = ["sliding_attention"] * self.num_hidden_layers
        if not self.use_sliding_window or not self.sliding_window:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise RQError(f"config.json: layer_types has {len(self.layer_types)} entries for "
                          f"{self.num_hidden_layers} layers")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        D, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, hd
        self.scale = hd ** -0.5
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=args.attention_bias)
        self.k_proj = nn.Linear(D, self.n_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(D, self.n_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=args.attention_bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)  # per head, before RoPE
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        theta, scaling = rope_params(vars(args))
        self.rope = make_rope(hd, theta, scaling, max_position_embeddings=args.max_position_embeddings)
        sliding = args.layer_types[layer_idx] == "sliding_attention"
        self.window = args.sliding_window if sliding else None

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        o = attend(cache, q, k, v, scale=self.scale, window=self.window)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        D = args.hidden_size
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(D, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(D, args.moe_intermediate_size, args.num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        inds, w = route_softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        return combine_experts(self.switch_mlp(x, inds), w)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        moe = (layer_idx not in args.mlp_only_layers and args.num_experts > 0
               and (layer_idx + 1) % args.decoder_sparse_step == 0)
        self.mlp = SparseMoeBlock(args) if moe else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3MoeModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache if cache is not None else [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Qwen3MoeModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        h = self.model(inputs, cache)
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    @property
    def layers(self) -> list:
        return self.model.layers

    def make_cache(self, kv: Optional[KVSettings] = None) -> list:
        kv = kv or KVSettings()
        a = self.args
        return with_edge_layers([SlidingWindowCache(a.sliding_window) if t == "sliding_attention"
                                 else make_kv_cache(kv, layer=i, n_kv_heads=a.num_key_value_heads, head_dim=a.head_dim)
                                 for i, t in enumerate(a.layer_types)], kv)

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        return weights
