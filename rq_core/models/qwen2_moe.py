"""Qwen2-MoE (`qwen2_moe`): routed experts plus a shared expert behind a sigmoid gate.

Qwen3-MoE is this network without the shared expert and with per-head q/k RMSNorm: `qwen3_moe` builds on
this file, its ModelArgs saying which parts it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import mlx.core as mx
import mlx.nn as nn

from rq_core.errors import RQError
from rq_core.cache.kv_cache import KVSettings, with_edge_layers
from rq_core.models.base import (MLP, Attention, BaseModelArgs, SwitchGLU, attend, attention_cache, cache_offset,
                                 combine_experts, decode_graph, lm_logits, make_rope, paged_experts, rope_params,
                                 route_softmax_topk, run_layers, stack_experts)


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "qwen2_moe"
    hidden_size: int = 2048
    num_hidden_layers: int = 24
    intermediate_size: int = 5632
    num_attention_heads: int = 16
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    num_experts: int = 60
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    norm_topk_prob: bool = False
    qkv_bias: bool = True
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

    qk_norm: ClassVar[bool] = False  # per-head q/k RMSNorm before RoPE

    @property
    def projection_biases(self) -> tuple[bool, bool]:
        """(q/k/v, o) biases: Qwen2-MoE biases q, k and v only."""
        return self.qkv_bias, False

    def default_layer_types(self) -> list[str]:
        # transformers' rule: odd-numbered layers below max_window_layers slide when enabled.
        return ["sliding_attention" if self.use_sliding_window and (i + 1) % 2 and i < self.max_window_layers
                else "full_attention" for i in range(self.num_hidden_layers)]

    def __post_init__(self) -> None:
        if self.num_local_experts is not None:
            self.num_experts = self.num_local_experts
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = self.default_layer_types()
        if not self.use_sliding_window or not self.sliding_window:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise RQError(f"config.json: layer_types has {len(self.layer_types)} entries for "
                          f"{self.num_hidden_layers} layers")


def attention(args: ModelArgs, layer_idx: int) -> Attention:
    """The layer's attention, with the biases, q/k norm and window its ModelArgs names."""
    theta, scaling = rope_params(vars(args))
    rope = make_rope(args.head_dim, theta, scaling, max_position_embeddings=args.max_position_embeddings)
    qkv_bias, o_bias = args.projection_biases
    sliding = args.layer_types[layer_idx] == "sliding_attention"
    return Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                     qkv_bias=qkv_bias, o_bias=o_bias, qk_norm_eps=args.rms_norm_eps if args.qk_norm else None,
                     rope=rope, window=args.sliding_window if sliding else None)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        D = args.hidden_size
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(D, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(D, args.moe_intermediate_size, args.num_experts)
        self.has_shared_expert = args.shared_expert_intermediate_size is not None
        if self.has_shared_expert:
            self.shared_expert = MLP(D, args.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.output(x, *self.route(x))

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return route_softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)

    def output(self, x: mx.array, inds: mx.array, w: mx.array, experts: Optional[Callable] = None) -> mx.array:
        """The block's output for routing (inds, w); `experts(x, inds)`: the routed experts (default switch_mlp)."""
        y = combine_experts((experts or self.switch_mlp)(x, inds), w)
        if self.has_shared_expert:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class DecoderLayer(nn.Module):
    traced_decode = True  # a decode step's layer with a compressed cache or a ring is one graph (base.decode_layer)

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = attention(args, layer_idx)
        moe = (layer_idx not in args.mlp_only_layers and args.num_experts > 0
               and (layer_idx + 1) % args.decoder_sparse_step == 0)
        self.mlp = SparseMoeBlock(args) if moe else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        q, k, v = self.attention_inputs(x, cache_offset(cache))
        a = self.self_attn
        o = attend(cache, q, k, v, scale=a.scale, window=a.window)
        pager = paged_experts(self.mlp.switch_mlp, x) if isinstance(self.mlp, SparseMoeBlock) else None
        if pager is None:
            return self.attention_output_and_mlp(x, o)
        h, inds, w = self.attention_output_and_routing(x, o)
        return self.moe_output(h, pager.serve(inds), w)

    # the cache's attention between two traced graphs (decode_graph): everything before it, everything after
    @decode_graph
    def attention_inputs(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.project(self.input_layernorm(x), offset)

    @decode_graph(calls_experts=True)
    def attention_output_and_mlp(self, x: mx.array, o: mx.array) -> mx.array:
        h = x + self.self_attn.output(o)
        return h + self.mlp(self.post_attention_layernorm(h))

    # a paged decode step: the same, its routing read between two graphs (base.paged_experts)
    @decode_graph
    def attention_output_and_routing(self, x: mx.array, o: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        h = x + self.self_attn.output(o)
        return (h, *self.mlp.route(self.post_attention_layernorm(h)))

    @decode_graph(reads_banks=True)
    def moe_output(self, h: mx.array, slots: mx.array, w: mx.array) -> mx.array:
        return h + self.mlp.output(self.post_attention_layernorm(h), slots, w, self.mlp.switch_mlp.compute)


class QwenMoeModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.norm(run_layers(self.layers, self.embed_tokens(inputs), cache))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = QwenMoeModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, last: bool = False) -> mx.array:
        """Logits [B, L, vocab]; `last`: the last position's alone ([B, 1, vocab]: a prompt's end needs no more)."""
        h = self.model(inputs, cache)
        return lm_logits(self, h[:, -1:] if last else h, self.model.embed_tokens)

    @property
    def layers(self) -> list:
        return self.model.layers

    def make_cache(self, kv: Optional[KVSettings] = None) -> list:
        kv = kv or KVSettings()
        return with_edge_layers([attention_cache(layer.self_attn, kv, i) for i, layer in enumerate(self.layers)], kv)

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        return weights
