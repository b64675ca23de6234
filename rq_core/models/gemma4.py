"""Gemma 4 text model (`gemma4` multimodal release with a nested `text_config`, or `gemma4_text`).

Matches transformers' `Gemma4ForConditionalGeneration` / `Gemma4ForCausalLM` on text. Per layer:
sliding or full attention (full layers may have their own head dim and kv-head count, K = V
sharing via `attention_k_eq_v`, proportional partial RoPE), q/k RMSNorm and a scale-free v norm,
attention scale 1; a GeGLU MLP, plus (with `enable_moe_block`) routed GeGLU experts in parallel;
sandwich norms, per-layer embeddings (PLE) when `hidden_size_per_layer_input` > 0, a learned
layer scalar, final logit soft-capping; KV sharing (`num_kv_shared_layers`: the last layers reuse an
earlier layer's K/V; each keeps its own cache of them) with double-wide MLPs. Vision/audio towers are skipped.
Parameter names follow mlx-lm (`gemma4`: `language_model.model.…`; `gemma4_text`: `model.…`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from rq_core.errors import RQError
from rq_core.cache.kv_cache import KVSettings, with_edge_layers
from rq_core.models import text_config
from rq_core.models.base import (
    MLP,
    BaseModelArgs,
    SwitchGLU,
    attend,
    attention_cache,
    cache_offset,
    combine_experts,
    decode_graph,
    decode_layer,
    lm_logits,
    make_rope,
    paged_experts,
    rope_params,
    route_softmax_topk,
    run_layers,
    stack_experts,
    step_resume,
)

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_SKIP_PREFIXES = ("vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal_projector",
                  "vision_embedder")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str = "gemma4_text"
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: Optional[int] = None  # transformers' default for full layers: 512
    num_global_key_value_heads: Optional[int] = None
    per_layer_config: Optional[dict] = None  # transformers ≥5.2x: {layer index: {"head_dim", "num_key_value_heads"}}
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    rope_parameters: Optional[dict] = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: Optional[list] = None
    final_logit_softcapping: Optional[float] = None
    use_bidirectional_attention: Optional[str] = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: Optional[int] = None
    top_k_experts: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    multimodal: bool = False  # set by from_dict for a `gemma4` config with a nested text_config
    layer_head_dim: list = field(default_factory=list)
    layer_kv_heads: list = field(default_factory=list)
    kv_source: list = field(default_factory=list)  # per layer: None, or the layer whose K/V it reuses

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> "ModelArgs":
        text = text_config(params)
        if text is not params:  # the multimodal release: its model_type says how its tensors are named
            text = {**text, "model_type": params.get("model_type", "gemma4"), "multimodal": True}
        return super().from_dict(text)

    def __post_init__(self):
        if self.use_bidirectional_attention == "all":
            raise RQError("gemma4: use_bidirectional_attention='all' (a non-causal model) is not supported")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_approx"):
            raise RQError(f"gemma4: hidden_activation={self.hidden_activation!r} is not supported")
        if self.layer_types is None:  # transformers' default: every 6th layer full
            self.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if self.layer_types[-1] != "full_attention":  # transformers forces this too
            self.layer_types[-1] = "full_attention"
        unknown = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise RQError(f"gemma4: unknown layer types {unknown}")
        if self.rope_parameters is None:
            self.rope_parameters = _DEFAULT_ROPE
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise RQError("gemma4: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        # Per-layer head dim / kv heads, as transformers resolves them.
        if self.per_layer_config is not None:
            overrides = {int(k): v for k, v in self.per_layer_config.items()}
        else:
            full = {"head_dim": self.global_head_dim or 512}
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            overrides = {i: full for i, t in enumerate(self.layer_types) if t == "full_attention"}
        self.layer_head_dim = [overrides.get(i, {}).get("head_dim", self.head_dim)
                               for i in range(self.num_hidden_layers)]
        self.layer_kv_heads = [overrides.get(i, {}).get("num_key_value_heads", self.num_key_value_heads)
                               for i in range(self.num_hidden_layers)]
        # KV sharing: the last num_kv_shared_layers layers reuse the K/V of the last earlier layer of their type.
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        last_of_type = {t: i for i, t in enumerate(self.layer_types[:first_shared])}
        self.kv_source = []
        for i, t in enumerate(self.layer_types):
            if i < first_shared:
                self.kv_source.append(None)
            elif t not in last_of_type:
                raise RQError(f"gemma4: layer {i} ({t}) shares K/V but no earlier layer of that type computes them")
            else:
                self.kv_source.append(last_of_type[t])


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


def _rms(x: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, None, eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        self.layer_type = args.layer_types[i]
        self.is_sliding = self.layer_type == "sliding_attention"
        self.window = args.sliding_window if self.is_sliding else None
        self.head_dim = hd = args.layer_head_dim[i]
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.layer_kv_heads[i]
        self.k_eq_v = args.attention_k_eq_v and not self.is_sliding
        self.shared = args.kv_source[i] is not None  # K/V come from an earlier layer: no k/v weights
        self.eps = args.rms_norm_eps
        d, b = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=b)
        if not self.shared:
            self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=b)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=b)
            self.k_norm = nn.RMSNorm(hd, eps=self.eps)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=b)
        self.q_norm = nn.RMSNorm(hd, eps=self.eps)
        # rope_params drops a "default" type's settings: Gemma 4's rotates the whole head whatever
        # partial_rotary_factor says (as transformers does).
        self.rope = make_rope(hd, *rope_params(vars(args), self.layer_type))

    def __call__(self, x: mx.array, cache: Any = None,
                 shared_kv: Optional[tuple[mx.array, mx.array]] = None) -> tuple[mx.array, tuple[mx.array, mx.array]]:
        """→ (output, (k, v) of the new tokens). A KV-sharing layer takes (k, v) from its source layer and
        appends them to its own cache (the same K/V, so the same attention as transformers' reuse)."""
        offset = cache_offset(cache)
        q, (k, v) = self.query(x, offset), shared_kv if self.shared else self.keys_values(x, offset)
        return self.output(attend(cache, q, k, v, scale=1.0, window=self.window)), (k, v)

    def query(self, x: mx.array, offset: int | mx.array) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        return self.rope(q, offset=offset)

    def keys_values(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k_raw = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = k_raw if self.k_eq_v else self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        k = self.rope(self.k_norm(k_raw).transpose(0, 2, 1, 3), offset=offset)
        return k, _rms(v, self.eps).transpose(0, 2, 1, 3)

    def output(self, o: mx.array) -> mx.array:
        B, _, L, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Router(nn.Module):
    """Scale-free RMSNorm → ·scale/√d → logits → softmax top-k, renormalised, times a per-expert scale."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.k, self.eps = args.top_k_experts, args.rms_norm_eps
        self.root = args.hidden_size ** -0.5
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        h = _rms(x, self.eps) * self.scale * self.root
        # float32 logits: the weights stay float32 through the per-expert scale, as in transformers
        inds, w = route_softmax_topk(self.proj(h).astype(mx.float32), self.k, norm_topk_prob=True)
        return inds, w * self.per_expert_scale[inds].astype(w.dtype)


class Experts(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                    activation=geglu)

    def __call__(self, x: mx.array, inds: mx.array, w: mx.array, experts: Optional[Callable] = None) -> mx.array:
        """`experts(x, inds)`: the routed experts (default switch_glu; a paged step: its banks' slots)."""
        return combine_experts((experts or self.switch_glu)(x, inds), w)


class DecoderLayer(nn.Module):
    traced_decode = True  # a decode step's layer with a compressed cache or a ring is one graph (base.decode_layer)

    def __init__(self, args: ModelArgs, i: int):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.layer_type = args.layer_types[i]
        self.self_attn = Attention(args, i)
        wide = args.use_double_wide_mlp and self.self_attn.shared  # transformers widens only KV-sharing layers
        self.mlp = MLP(d, args.intermediate_size * (2 if wide else 1), activation=geglu)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.enable_moe = args.enable_moe_block
        if self.enable_moe:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(d, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(d, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(d, eps=eps)
        self.ple = bool(args.hidden_size_per_layer_input)
        if self.ple:
            self.per_layer_input_gate = nn.Linear(d, args.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, d, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(d, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache: Any = None, per_layer_input: Optional[mx.array] = None,
                 shared_kv: Optional[tuple] = None) -> tuple[mx.array, tuple[mx.array, mx.array]]:
        a, offset = self.self_attn, cache_offset(cache)
        if a.shared:
            q, (k, v) = self.attention_query(x, offset), shared_kv
        else:
            q, k, v = self.attention_inputs(x, offset)
        o = attend(cache, q, k, v, scale=1.0, window=a.window)
        rest = (per_layer_input,) if self.ple else ()  # decode_graph takes arrays, not None
        pager = paged_experts(self.experts.switch_glu, x) if self.enable_moe else None
        if pager is None:
            return self.attention_output_and_mlp(x, o, *rest), (k, v)
        h, inds, w = self.attention_output_and_routing(x, o)
        return self.mlp_output(h, pager.serve(inds), w, *rest), (k, v)

    # the cache's attention between traced graphs (decode_graph): everything before it, everything after
    @decode_graph
    def attention_query(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return self.self_attn.query(self.input_layernorm(x), offset)

    @decode_graph
    def attention_inputs(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        h = self.input_layernorm(x)
        return (self.self_attn.query(h, offset), *self.self_attn.keys_values(h, offset))

    @decode_graph(calls_experts=True)
    def attention_output_and_mlp(self, x: mx.array, o: mx.array, per_layer_input: Optional[mx.array] = None) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn.output(o))
        inds, w = self.router(h) if self.enable_moe else (None, None)
        return self._feed_forward(h, inds, w, per_layer_input)

    # a paged decode step: the same, its routing read between two graphs (base.paged_experts)
    @decode_graph
    def attention_output_and_routing(self, x: mx.array, o: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        h = x + self.post_attention_layernorm(self.self_attn.output(o))
        return (h, *self.router(h))

    @decode_graph(reads_banks=True)
    def mlp_output(self, h: mx.array, slots: mx.array, w: mx.array, per_layer_input: Optional[mx.array] = None) -> mx.array:
        return self._feed_forward(h, slots, w, per_layer_input, self.experts.switch_glu.compute)

    def _feed_forward(self, h: mx.array, inds: Optional[mx.array], w: Optional[mx.array],
                      per_layer_input: Optional[mx.array], experts: Optional[Callable] = None) -> mx.array:
        y = self.mlp(self.pre_feedforward_layernorm(h))
        if self.enable_moe:  # experts in parallel with the dense MLP, both fed the residual stream
            y2 = self.experts(self.pre_feedforward_layernorm_2(h), inds, w, experts)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(y2)
        h = h + self.post_feedforward_layernorm(y)
        if self.ple:
            g = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar.astype(h.dtype)


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.ple_dim = args.hidden_size_per_layer_input
        if self.ple_dim:
            n = args.num_hidden_layers
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, n * self.ple_dim)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, n * self.ple_dim, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(self.ple_dim, eps=args.rms_norm_eps)

    def _per_layer_inputs(self, inputs: mx.array, h: mx.array) -> mx.array:
        n = self.args.num_hidden_layers
        tok = self.embed_tokens_per_layer(inputs)
        tok = tok * mx.array(math.sqrt(self.ple_dim), dtype=tok.dtype)
        ctx = self.per_layer_model_projection(h) * mx.array(self.args.hidden_size ** -0.5, dtype=h.dtype)
        ctx = self.per_layer_projection_norm(ctx.reshape(*h.shape[:-1], n, self.ple_dim))
        return (ctx + tok.reshape(*inputs.shape, n, self.ple_dim)) * mx.array(2.0 ** -0.5, dtype=h.dtype)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        h = self.embed_tokens(inputs)
        h = h * mx.array(math.sqrt(self.args.hidden_size), dtype=h.dtype)  # scale rounded to the weights' dtype
        ple = self._per_layer_inputs(inputs, h) if self.ple_dim else None
        # each layer's new K/V, for the KV-sharing layers after it (kept across the runs of a resumed step, which
        # skip the layers before the one it runs again from)
        rs = step_resume()
        kvs: dict[int, tuple] = rs.carry.setdefault("kvs", {}) if rs is not None else {}

        def step(i: int, layer: nn.Module, h: mx.array, c: Any) -> mx.array:
            extra = (ple[:, :, i] if ple is not None else None, kvs.get(self.args.kv_source[i]))
            out = decode_layer(layer, h, c, *extra) if rs is None else None
            h, kvs[i] = layer(h, c, *extra) if out is None else out
            return h

        return self.norm(run_layers(self.layers, h, cache, step))


class LanguageModel(nn.Module):
    """Holds `model` (+ `lm_head` when untied): the multimodal release's `language_model`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        if args.multimodal:
            self.language_model = LanguageModel(args)
        else:
            self.model = TextModel(args)
            if not args.tie_word_embeddings:
                self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def _lm(self) -> nn.Module:
        return self.language_model if self.args.multimodal else self

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, last: bool = False) -> mx.array:
        """Logits [B, L, vocab]; `last`: the last position's alone ([B, 1, vocab]: a prompt's end needs no more)."""
        lm = self._lm
        h = lm.model(inputs, cache)
        logits = lm_logits(lm, h[:, -1:] if last else h, lm.model.embed_tokens)
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    @property
    def layers(self) -> list:
        return self._lm.model.layers

    def make_cache(self, kv: Optional[KVSettings] = None) -> list:
        """Sliding layers: a ring-buffer fp16 window cache; full layers: the chosen KV mode."""
        kv = kv or KVSettings()
        return with_edge_layers([attention_cache(layer.self_attn, kv, i)
                                 for i, layer in enumerate(self.layers)], kv)

    def sanitize(self, weights: dict) -> dict:
        """transformers / hub names → ours: drops vision/audio towers and rotary buffers, splits the fused
        expert `gate_up_proj` into the SwitchGLU banks, maps `model.language_model.*` (multimodal) or
        `model.*` (text-only) onto this module's layout."""
        lm_prefix = "language_model.model." if self.args.multimodal else "model."
        shared = {f"layers.{i}.self_attn.{n}." for i, s in enumerate(self.args.kv_source) if s is not None
                  for n in ("k_proj", "v_proj", "k_norm", "v_norm")}
        out = {}
        for k, v in weights.items():
            if "rotary_emb" in k or k.endswith(("input_max", "input_min", "output_max", "output_min")):
                continue
            if shared and any(s in k for s in shared):
                continue  # KV-sharing layers' own k/v weights are unused (transformers ignores them too)
            key = k[len("model."):] if k.startswith("model.") else k
            if key.startswith(_SKIP_PREFIXES):
                continue
            if key.startswith("language_model."):
                key = key[len("language_model."):]
                key = key[len("model."):] if key.startswith("model.") else key
            if key.startswith("lm_head."):
                if self.args.tie_word_embeddings:
                    continue
                out[("language_model." if self.args.multimodal else "") + key] = v
                continue
            out[lm_prefix + key] = v
        if self.args.enable_moe_block:
            for i in range(self.args.num_hidden_layers):
                stack_experts(out, f"{lm_prefix}layers.{i}", self.args.num_experts,
                              dst="experts.switch_glu")
        return out
