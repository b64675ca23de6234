"""Nemotron-H (Nemotron 3 Nano / Super): hybrid Mamba2 / attention / MoE stack.

Matches transformers' `NemotronHForCausalLM`. Layer kinds (`hybrid_override_pattern` chars or
`layers_block_type` names): `M` Mamba2 mixer, `*` attention (no RoPE), `E` MoE with ReLU² experts,
sigmoid group-top-k routing with `e_score_correction_bias`, a shared expert and optional latent
projections (`moe_latent_size`), `-` dense ReLU² MLP. Each block is `x + mixer(norm(x))`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from rq_core.errors import RQError
from rq_core.cache.kv_cache import KVSettings, with_edge_layers
from rq_core.models.base import (
    MLP,
    Attention,
    BaseModelArgs,
    SwitchGLU,
    attend,
    attention_cache,
    combine_experts,
    decode_graph,
    lm_logits,
    paged_experts,
    relu2,
    route_sigmoid_group_topk,
    run_layers,
    stack_experts,
)
from rq_core.models.mamba import Mamba2Mixer, MambaCache

_BLOCK_CHARS = {
    "linear_attention": "M", "mamba": "M", "conv": "M",
    "full_attention": "*", "attention": "*",
    "moe": "E", "mlp": "-",
}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "nemotron_h"
    vocab_size: int = 131072
    hidden_size: int = 4096
    hybrid_override_pattern: Optional[Union[str, list]] = None
    layers_block_type: Optional[list] = None
    layer_types: Optional[list] = None
    num_attention_heads: int = 32
    num_key_value_heads: Optional[int] = 8
    head_dim: Optional[int] = 128
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    intermediate_size: int = 21504
    mlp_bias: bool = False
    mlp_hidden_act: str = "relu2"
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    mamba_proj_bias: bool = False
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    time_step_min: float = 0.001
    use_conv_bias: bool = True
    use_bias: bool = False
    n_routed_experts: int = 8
    n_shared_experts: Optional[int] = 1
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: Optional[int] = None
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    # Legacy spellings some hub configs use (transformers' NemotronHConfig accepts them).
    mamba_n_groups: Optional[int] = None
    mamba_d_conv: Optional[int] = None
    mamba_chunk_size: Optional[int] = None
    mamba_dt_min: Optional[float] = None
    mamba_conv_bias: Optional[bool] = None

    def __post_init__(self):
        for legacy, field in (("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel"),
                              ("mamba_chunk_size", "chunk_size"), ("mamba_dt_min", "time_step_min"),
                              ("mamba_conv_bias", "use_conv_bias")):
            if getattr(self, legacy) is not None:
                setattr(self, field, getattr(self, legacy))
        if self.hybrid_override_pattern is not None:
            pattern = "".join(self.hybrid_override_pattern)
        elif self.layers_block_type or self.layer_types:
            types = self.layers_block_type or self.layer_types
            unknown = sorted(set(types) - set(_BLOCK_CHARS))
            if unknown:
                raise RQError(f"nemotron_h: unknown layer types {unknown} (known: {', '.join(_BLOCK_CHARS)})")
            pattern = "".join(_BLOCK_CHARS[t] for t in types)
        else:
            raise RQError("nemotron_h: config.json has neither hybrid_override_pattern nor layers_block_type")
        bad = sorted(set(pattern) - set("M*E-"))
        if bad:
            raise RQError(f"nemotron_h: unknown pattern characters {bad} (known: M * E -)")
        self.pattern = pattern
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name, act in (("mlp_hidden_act", self.mlp_hidden_act), ("mamba_hidden_act", self.mamba_hidden_act)):
            want = "relu2" if name == "mlp_hidden_act" else "silu"
            if act != want:
                raise RQError(f"nemotron_h: {name}={act!r} is not supported (only {want!r})")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.pattern)


class NoCache:
    """Cache slot of a stateless layer (MLP / MoE): keeps the one-entry-per-layer list uniform."""

    def __init__(self) -> None:
        self.offset = 0

    def end_prefill(self) -> None:
        pass

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset -= n
        return n

    def mark(self) -> Callable[[], None]:
        offset = self.offset
        return lambda: self.trim(self.offset - offset)

    nbytes = 0
    fp16_nbytes = 0
    state: tuple = ()


class MoEGate(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        self.e_score_correction_bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        a = self.args
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T  # router runs in fp32
        return route_sigmoid_group_topk(logits, a.num_experts_per_tok, correction_bias=self.e_score_correction_bias,
                                        n_group=a.n_group, topk_group=a.topk_group, norm_topk_prob=a.norm_topk_prob,
                                        routed_scaling_factor=a.routed_scaling_factor)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.latent = args.moe_latent_size is not None
        expert_dim = args.moe_latent_size if self.latent else args.hidden_size
        self.gate = MoEGate(args)
        self.switch_mlp = SwitchGLU(expert_dim, args.moe_intermediate_size, args.n_routed_experts,
                                    activation=relu2, gated=False)
        self.shared_experts = MLP(args.hidden_size, args.moe_shared_expert_intermediate_size, bias=args.mlp_bias,
                                  gated=False)
        if self.latent:
            self.fc1_latent_proj = nn.Linear(args.hidden_size, args.moe_latent_size, bias=args.mlp_bias)
            self.fc2_latent_proj = nn.Linear(args.moe_latent_size, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.output(x, *self.gate(x))

    def output(self, x: mx.array, inds: mx.array, w: mx.array, experts: Optional[Callable] = None) -> mx.array:
        """The block's output for routing (inds, w); `experts(h, inds)`: the routed experts (default switch_mlp)."""
        h = self.fc1_latent_proj(x) if self.latent else x
        y = combine_experts((experts or self.switch_mlp)(h, inds), w)
        if self.latent:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


class Block(nn.Module):
    traced_decode = True  # a decode step's attention block with a compressed cache or a ring: one graph (decode_layer)

    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        self.block_type = kind
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)
        if kind == "M":
            self.mixer = Mamba2Mixer(args.hidden_size, args.mamba_num_heads, args.mamba_head_dim, args.ssm_state_size,
                                     args.n_groups, args.conv_kernel, chunk_size=args.chunk_size,
                                     eps=args.layer_norm_epsilon, proj_bias=args.use_bias,
                                     conv_bias=args.use_conv_bias, dt_min=args.time_step_min)
        elif kind == "*":  # no positional encoding
            b = args.attention_bias
            self.mixer = Attention(args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                                   args.head_dim, qkv_bias=b, o_bias=b)
        elif kind == "E":
            self.mixer = MoE(args)
        else:
            self.mixer = MLP(args.hidden_size, args.intermediate_size, bias=args.mlp_bias, gated=False)

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        if self.block_type == "*":
            q, k, v = self.attention_inputs(x)
            return self.attention_output(x, attend(cache, q, k, v, scale=self.mixer.scale))
        if self.block_type == "M":
            if cache is None or cache.conv_state is None:  # no state yet: a fresh sequence
                return x + self.mixer(self.norm(x), cache)
            y, cache.conv_state, cache.ssm_state = self.mamba_step(x, cache.conv_state, cache.ssm_state)
            cache.offset += x.shape[1]
            return y
        if cache is not None:
            cache.offset += x.shape[1]
        pager = paged_experts(self.mixer.switch_mlp, x) if self.block_type == "E" else None
        if pager is None:
            return self.feed_forward(x)
        inds, w = self.moe_routing(x)
        return self.moe_output(x, pager.serve(inds), w)

    # each block's work around its cache as traced graphs (decode_graph)
    @decode_graph
    def attention_inputs(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.mixer.project(self.norm(x))  # no positional encoding: no offset

    @decode_graph
    def attention_output(self, x: mx.array, o: mx.array) -> mx.array:
        return x + self.mixer.output(o)

    @decode_graph
    def mamba_step(self, x: mx.array, conv_state: mx.array, ssm_state: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        y, conv_state, ssm_state = self.mixer.mix(self.norm(x), conv_state, ssm_state)
        return x + y, conv_state, ssm_state

    @decode_graph(calls_experts=True)
    def feed_forward(self, x: mx.array) -> mx.array:
        return x + self.mixer(self.norm(x))

    # a paged decode step of a MoE block: its routing read between two graphs (base.paged_experts)
    @decode_graph
    def moe_routing(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.mixer.gate(self.norm(x))

    @decode_graph(reads_banks=True)
    def moe_output(self, x: mx.array, slots: mx.array, w: mx.array) -> mx.array:
        return x + self.mixer.output(self.norm(x), slots, w, self.mixer.switch_mlp.compute)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args, c) for c in args.pattern]
        self.norm_f = nn.RMSNorm(args.hidden_size, eps=args.layer_norm_epsilon)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.norm_f(run_layers(self.layers, self.embeddings(inputs), cache))


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.backbone = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, last: bool = False) -> mx.array:
        """Logits [B, L, vocab]; `last`: the last position's alone ([B, 1, vocab]: a prompt's end needs no more)."""
        h = self.backbone(inputs, cache)
        return lm_logits(self, h[:, -1:] if last else h, self.backbone.embeddings)

    @property
    def layers(self) -> list:
        return self.backbone.layers

    def make_cache(self, kv: Optional[KVSettings] = None) -> list:
        """Attention layers: a KV cache of the chosen mode; Mamba layers: conv/SSM state; MLP/MoE: `NoCache`."""
        kv = kv or KVSettings()
        caches = [attention_cache(layer.mixer, kv, i) if layer.block_type == "*"
                  else MambaCache() if layer.block_type == "M" else NoCache() for i, layer in enumerate(self.layers)]
        return with_edge_layers(caches, kv)

    def sanitize(self, weights: dict) -> dict:
        """Hub names (`backbone.…`, per-expert `experts.<e>.{up,down}_proj`, conv weight [C, 1, K]),
        transformers 5 in-memory names (`model.…`, stacked `experts.{up,down}_proj`) and mlx-lm's
        (`switch_mlp.fc1/fc2`) → ours."""
        out = {}
        for k, v in weights.items():
            if k.startswith("mtp.") or k.startswith("model.mtp."):
                continue  # multi-token-prediction head: not used for generation
            if k.startswith("model."):
                k = "backbone." + k[len("model."):]
            k = k.replace(".switch_mlp.fc1.", ".switch_mlp.up_proj.")  # mlx-lm's bank names
            k = k.replace(".switch_mlp.fc2.", ".switch_mlp.down_proj.")
            if k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[-1] != 1:
                v = v.swapaxes(1, 2)  # torch [C, 1, K] → mlx [C, K, 1]
            out[k] = v
        for i, c in enumerate(self.args.pattern):
            if c == "E":
                stack_experts(out, f"backbone.layers.{i}.mixer", self.args.n_routed_experts,
                              names=("up_proj", "down_proj"), dst="switch_mlp")
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
