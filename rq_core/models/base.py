"""Small primitives shared by the model families: config args, RoPE, layers, routed experts, routing,
caches.

Names follow mlx-lm (`switch_mlp.{gate,up,down}_proj`, `to_quantized`) so checkpoints interoperate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import threading
import typing
import weakref
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from rq_core.cache.kv_cache import KVSettings, Mask, make_kv_cache, row_index


# --------------------------------------------------------------------------------------------- args
@dataclasses.dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict[str, Any]):
        """Build from a config.json dict, ignoring keys the dataclass does not name; the values are
        validated (types from the field annotations, then ranges: `validate_args`)."""
        names = inspect.signature(cls).parameters
        given = {k: v for k, v in params.items() if k in names}
        _check_types(cls, given)
        args = cls(**given)
        validate_args(args)
        return args


# ------------------------------------------------------------------------------------- validation
# config.json is untrusted: every family's ModelArgs passes through these checks, so a bad value is one
# clear line at load instead of a traceback, a hang (a billion layers) or a silently wrong model.
_MAX_INT = 1 << 26  # no size, count or context in a config is larger
_MAX = {"vocab_size": 1 << 21, "vocab_size_per_layer_input": 1 << 21, "num_hidden_layers": 1024,
        "num_experts": 1 << 14, "n_routed_experts": 1 << 14, "num_local_experts": 1 << 14}
# sizes that must be >= 1 when present (None = unset is allowed for Optional fields)
_POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size", "max_position_embeddings", "intermediate_size", "decoder_sparse_step",
             "moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
             "global_head_dim", "num_global_key_value_heads", "moe_latent_size", "vocab_size_per_layer_input",
             "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "conv_kernel", "chunk_size",
             "n_group", "topk_group")
# (experts chosen per token, experts): 1 <= k <= E whenever the model has experts
_TOP_K = (("num_experts_per_tok", "num_experts"), ("num_experts_per_tok", "n_routed_experts"),
          ("top_k_experts", "num_experts"))


def _bad(msg: str):
    from rq_core.errors import RQError

    return RQError(f"config.json: {msg}")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _type_ok(v: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        return any(_type_ok(v, h) for h in typing.get_args(hint))
    if hint is type(None):
        return v is None
    if hint is bool:
        return isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if hint in (str, list, dict):
        return isinstance(v, hint)
    if origin in (list, dict):
        return isinstance(v, origin)
    return True  # Any


def _check_types(cls: type, given: dict[str, Any]) -> None:
    hints = typing.get_type_hints(cls)
    for k, v in given.items():
        hint = hints.get(k, Any)
        if not _type_ok(v, hint):
            want = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
            raise _bad(f"{k} should be {want} (got {_short(v)})")
        if isinstance(v, int) and not isinstance(v, bool) and not int(k in _POSITIVE) <= v <= _MAX.get(k, _MAX_INT):
            raise _bad(f"{k} = {v} is out of range ({int(k in _POSITIVE)}..{_MAX.get(k, _MAX_INT)})")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_rope(dims: int, base: Any, scaling: Any) -> None:
    """The RoPE settings of a config (rope_theta, rope_scaling / rope_parameters) are numbers in range."""
    if not (_num(base) and base > 0):
        raise _bad(f"rope_theta must be a number > 0 (got {_short(base)})")
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise _bad(f"rope_scaling / rope_parameters should be an object (got {_short(scaling)})")
    positive = ["factor", "partial_rotary_factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings", "beta_fast", "beta_slow"]
    finite = ["attention_factor", "mscale", "mscale_all_dim"]
    for k in positive + finite:
        v = scaling.get(k)
        if v is not None and not (_num(v) and (k in finite or v > 0)):
            raise _bad(f"rope {k} must be a {'positive ' if k in positive else ''}number (got {_short(v)})")
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial > 1 or int(dims * partial) < 2:
        raise _bad(f"rope partial_rotary_factor = {partial} leaves no dims to rotate, or more than a head has")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("linear", "llama3", "yarn") and "factor" not in scaling:
        raise _bad(f"rope type {_short(kind)} needs a factor")
    if kind == "llama3" and scaling.get("low_freq_factor", 1.0) == scaling.get("high_freq_factor", 4.0):
        raise _bad("rope low_freq_factor and high_freq_factor must differ")


def validate_args(a: Any) -> None:
    """Ranges and relations of a family's ModelArgs (after its __post_init__ derived the rest)."""
    for k in _POSITIVE:
        v = getattr(a, k, None)
        if v is not None and not (isinstance(v, int) and 1 <= v <= _MAX.get(k, _MAX_INT)):
            raise _bad(f"{k} must be a positive integer (got {_short(v)})")
    for k_name, e_name in _TOP_K:
        k, e = getattr(a, k_name, None), getattr(a, e_name, None)
        if k is None or not e:
            continue  # no experts (a dense model), or this family names them otherwise
        if not (isinstance(k, int) and 1 <= k <= e):
            raise _bad(f"{k_name} = {_short(k)} must be between 1 and {e_name} = {e}")
    heads = getattr(a, "num_attention_heads", None)
    for kv in set(getattr(a, "layer_kv_heads", None) or [getattr(a, "num_key_value_heads", None)]):
        if kv is not None and (not isinstance(kv, int) or kv < 1 or heads % kv):
            raise _bad(f"num_attention_heads = {heads} is not a multiple of the key/value heads ({_short(kv)})")
    for hd in set(getattr(a, "layer_head_dim", None) or []):
        if not isinstance(hd, int) or not 1 <= hd <= _MAX_INT:
            raise _bad(f"a layer's head_dim must be a positive integer (got {_short(hd)})")
    for k in ("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "time_step_min"):
        v = getattr(a, k, None)
        if v is not None and not v > 0:
            raise _bad(f"{k} must be > 0 (got {_short(v)})")
    cap = getattr(a, "final_logit_softcapping", None)
    if cap is not None and cap < 0:
        raise _bad(f"final_logit_softcapping must be >= 0 (got {_short(cap)})")
    types = getattr(a, "layer_types", None)
    if hasattr(a, "sliding_window") and isinstance(types, list) and "sliding_attention" in types:
        w = getattr(a, "sliding_window", None)
        if not (isinstance(w, int) and w >= 1):
            raise _bad(f"sliding layers need sliding_window >= 1 (got {_short(w)})")
    experts, groups, top_groups = (getattr(a, k, None) for k in ("n_routed_experts", "n_group", "topk_group"))
    if experts and groups and (experts % groups or not 1 <= (top_groups or 0) <= groups):
        raise _bad(f"n_group = {groups} must divide n_routed_experts = {experts} and topk_group = "
                   f"{_short(top_groups)} be between 1 and n_group")
    mh, ng = getattr(a, "mamba_num_heads", None), getattr(a, "n_groups", None)
    if mh and ng and mh % ng:
        raise _bad(f"n_groups = {ng} must divide mamba_num_heads = {mh}")


# --------------------------------------------------------------------------------------------- RoPE
def rope_params(config: dict[str, Any], layer_type: Optional[str] = None) -> tuple[float, Optional[dict]]:
    """(theta, scaling dict or None) from a config, whichever way it spells them.

    transformers <5: `rope_theta` + `rope_scaling`; transformers 5: `rope_parameters`
    (`{"rope_type", "rope_theta", ...}`, or one such dict per layer type, e.g. Gemma's
    `{"sliding_attention": {...}, "full_attention": {...}}`).
    """
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        rp = next(iter(rp.values()))  # per-layer-type dict but no type asked: take the first
    scaling = config.get("rope_scaling")
    theta = config.get("rope_theta")
    if isinstance(rp, dict) and rp:
        theta = rp.get("rope_theta", theta)
        if scaling is None:
            scaling = rp
    if theta is None:
        theta = 10000.0
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        # plain RoPE, unless it rotates part of a head (transformers 5 reads partial_rotary_factor for every type)
        if kind == "default" and scaling.get("partial_rotary_factor", 1.0) == 1.0:
            scaling = None
    return float(theta), scaling


class _FreqRoPE(nn.Module):
    """RoPE with explicit inverse-frequency periods (mx.fast.rope `freqs`) and an optional input scale."""

    def __init__(self, dims: int, freqs: mx.array, traditional: bool = False, mscale: float = 1.0):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.mscale = mscale
        self._freqs = freqs

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if self.mscale != 1.0:
            x = x.at[..., : self.dims].multiply(self.mscale)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)


def _yarn(dims: int, base: float, cfg: dict, max_pos: Optional[int]) -> tuple[mx.array, float]:
    factor = float(cfg["factor"])
    orig = cfg.get("original_max_position_embeddings") or max_pos or 4096
    beta_fast, beta_slow = cfg.get("beta_fast", 32), cfg.get("beta_slow", 1)

    def corr_dim(rot: float) -> float:
        return (dims * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dims - 1)
    if cfg.get("truncate") is False:
        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extra_mask = 1.0 - ramp
    freq_extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    freq_inter = factor * freq_extra
    freqs = (freq_inter * freq_extra) / (freq_inter * extra_mask + freq_extra * (1 - extra_mask))

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.get("attention_factor") is not None:
        mscale = float(cfg["attention_factor"])
    elif cfg.get("mscale") and cfg.get("mscale_all_dim"):
        mscale = get_mscale(factor, cfg["mscale"]) / get_mscale(factor, cfg["mscale_all_dim"])
    else:
        mscale = get_mscale(factor)
    return freqs, mscale


def make_rope(dims: int, base: float, scaling: Optional[dict] = None, *, traditional: bool = False,
              max_position_embeddings: Optional[int] = None) -> nn.Module:
    """A RoPE module for `dims` rotated dims; `scaling` as from `rope_params` (None = plain RoPE).

    Supports rope types default, linear, llama3, yarn, proportional (Gemma: partial rotation
    inside a full head) and `partial_rotary_factor`. The module is called as rope(x, offset).
    """
    check_rope(dims, base, scaling)
    kind = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    partial = float(scaling.get("partial_rotary_factor", 1.0)) if scaling else 1.0
    if kind == "proportional":
        # Rotate the first `rotated` dims of a head but with exponents over the whole head.
        rotated = int(dims * partial)
        rotated -= rotated % 2
        factor = float(scaling.get("factor", 1.0))
        exps = mx.arange(0, rotated, 2, dtype=mx.float32) / dims
        freqs = mx.concatenate([factor * (base ** exps), mx.full(((dims - rotated) // 2,), mx.inf)])
        return _FreqRoPE(dims, freqs, traditional)
    rot = int(dims * partial)
    rot -= rot % 2
    if kind == "default":
        return nn.RoPE(rot, traditional=traditional, base=base)
    if kind == "linear":
        return nn.RoPE(rot, traditional=traditional, base=base, scale=1.0 / float(scaling["factor"]))
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling.get("original_max_position_embeddings", 8192)
        freqs = base ** (mx.arange(0, rot, 2, dtype=mx.float32) / rot)
        wavelens = 2 * mx.pi * freqs
        freqs = mx.where(wavelens > old / lo, freqs * factor, freqs)
        medium = (wavelens > old / hi) & (wavelens < old / lo)
        smooth = (old / wavelens - lo) / (hi - lo)
        freqs = mx.where(medium, freqs / ((1 - smooth) / factor + smooth), freqs)
        return _FreqRoPE(rot, freqs, traditional)
    if kind == "yarn":
        freqs, mscale = _yarn(rot, base, scaling, max_position_embeddings)
        return _FreqRoPE(rot, freqs, traditional, mscale)
    from rq_core.errors import RQError

    raise RQError(f"unsupported rope type {kind!r} (supported: default, linear, llama3, yarn, proportional)")


# ------------------------------------------------------------------------------------------ layers
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def relu2(x: mx.array) -> mx.array:
    return mx.square(nn.relu(x))


class MLP(nn.Module):
    """Dense MLP y = down(act(gate x, up x)), the dense counterpart of `SwitchGLU` (the same arguments):
    SwiGLU unless `activation` says otherwise; with `gated=False`, no gate_proj and y = down(act(up x))."""

    def __init__(self, dims: int, hidden: int, activation: Optional[Callable] = None, bias: bool = False,
                 gated: bool = True):
        super().__init__()
        self.gated = gated
        if gated:
            self.gate_proj = nn.Linear(dims, hidden, bias=bias)
        self.up_proj = nn.Linear(dims, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dims, bias=bias)
        self.activation = activation or (swiglu if gated else relu2)

    def __call__(self, x: mx.array) -> mx.array:
        up = self.up_proj(x)
        return self.down_proj(self.activation(self.gate_proj(x), up) if self.gated else self.activation(up))


class Attention(nn.Module):
    """Grouped-query attention through the layer's cache, with an optional per-head q/k RMSNorm (applied
    before RoPE), RoPE (none: no positional encoding) and sliding window."""

    def __init__(self, dims: int, n_heads: int, n_kv_heads: int, head_dim: int, *, qkv_bias: bool = False,
                 o_bias: bool = False, qk_norm_eps: Optional[float] = None, rope: Optional[nn.Module] = None,
                 window: Optional[int] = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(dims, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dims, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dims, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dims, bias=o_bias)
        self.qk_norm = qk_norm_eps is not None
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.rope = rope
        self.window = window

    def __call__(self, x: mx.array, cache: Any = None) -> mx.array:
        q, k, v = self.project(x, cache_offset(cache))
        return self.output(attend(cache, q, k, v, scale=self.scale, window=self.window))

    def project(self, x: mx.array, offset: int | mx.array = 0) -> tuple[mx.array, mx.array, mx.array]:
        """x [B, L, dims] → (q, k, v) [B, heads, L, head_dim], q and k normed and rotated for positions offset..."""
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        if self.rope is not None:
            q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        return q, k, v

    def output(self, o: mx.array) -> mx.array:
        """The attention's output [B, heads, L, head_dim] through o_proj → [B, L, dims]."""
        B, _, L, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


def cache_offset(cache: Any) -> int:
    """Positions the layer's cache has seen (0 without a cache): where the new tokens' RoPE starts."""
    return cache.offset if cache is not None else 0


# ------------------------------------------------------------------------------------ decode graphs
def decode_graph(method: Optional[Callable] = None, *, reads_banks: bool = False, calls_experts: bool = False) -> Callable:
    """A module method f(self, x, *args) that runs through mx.compile when x holds one token (x.shape[1] == 1: a
    decode step, whose shapes repeat, so one trace per module serves every step).

    On a GPU a decode step is bound by host time: MLX spends microseconds on each op it builds and launches, a
    48-layer MoE builds ~2,000 of them a token. A traced graph is replayed without Python and its elementwise
    chains become one kernel each. Longer inputs (a prompt) run the method as written, and so does a module's first
    one-token call. The trace holds the module's weights as constants: code that changes weights or their dtype
    after decoding calls `set_decode_graphs`. With the expert pager (`set_bank_inputs` registered its banks on the
    module): `reads_banks=True` methods take the banks as inputs of the graph, read anew at each replay, since the
    pager writes experts into their slots between steps; `calls_experts=True` methods, which call the routed experts
    (whose routing a paged call reads on the host), run as written. Int arguments are passed as int32 scalars, so a
    RoPE offset does not retrace.
    """
    if method is None:
        return functools.partial(decode_graph, reads_banks=reads_banks, calls_experts=calls_experts)
    name = method.__name__

    @functools.wraps(method)
    def run(self: nn.Module, x: mx.array, *args: Any) -> Any:
        graphs = self.__dict__.get("_decode_graphs")
        if x.ndim < 2 or x.shape[1] != 1 or graphs is False or (calls_experts and "_bank_inputs" in self.__dict__) \
                or getattr(_LAYER_GRAPH, "tracing", False):
            return method(self, x, *args)
        if graphs is None:
            graphs = self.__dict__["_decode_graphs"] = {}
        fn = graphs.get(name)
        if fn is None:
            # the first one-token call runs as written: whatever a module does once on its first call (experts
            # read from their pages, a lazy weight cast) happens outside the trace instead of in every replay
            if name not in graphs:
                graphs[name] = None
                return method(self, x, *args)
            # self weakly: the graph lives in self's __dict__, and a cycle would keep a dropped model's weights
            # alive until the cyclic collector runs (the bank inputs are modules below self: no cycle)
            banks = self.__dict__.get("_bank_inputs") if reads_banks else None
            fn = graphs[name] = mx.compile(functools.partial(method, weakref.proxy(self)), inputs=banks)
        return fn(x, *(_scalar(a) if isinstance(a, int) else a for a in args))

    return run


_LAYER_GRAPH = threading.local()  # tracing=True while a decode_layer graph is traced on this thread
LAYER_GRAPHS_KEPT = 4  # a layer's decode_layer graphs (launch plans) kept: a context grows through a few


class _TracedKV:
    """A cache inside its layer's traced decode graph (decode_layer): the arrays its decode_inputs gave are inputs of
    the graph, `attend` runs the cache's traced_attend on them, the buffers it writes are outputs."""

    def __init__(self, cache_type: type, plan: Any, query: tuple, offset: mx.array, arrays: list) -> None:
        self.cache_type, self.plan, self.query, self.offset, self.arrays = cache_type, plan, query, offset, arrays
        self.buffers: list[mx.array] = []

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask: Any = None) -> mx.array:
        # a compressed cache's plan (its launch) was made for the queries (shape, dtype, scale) of its last decode step
        # as written
        if self.query is not None and (tuple(queries.shape), queries.dtype, scale) != self.query:
            raise ValueError(f"decode_layer: queries {queries.shape} {queries.dtype} scale {scale} traced for a plan "
                             f"made for {self.query}")
        out, *self.buffers = self.cache_type.traced_attend(self.plan, self.arrays, queries, keys, values, scale=scale)
        return out


def decode_layer(layer: nn.Module, x: mx.array, cache: Any, *extra: Any) -> Any:
    """A one-token decode step of `layer(x, cache, *extra)` as one traced graph with its cache's attention inside, or
    None where that does not apply (the caller runs the layer as written). `extra`: the layer's other arguments
    (arrays, tuples of arrays, None); what the layer returns comes back with the same structure.

    On a GPU a decode step is bound by host time. decode_graph traces what comes before and after the cache's
    attention; the attention itself (the cache's append and its launch) ran as Python between them, every layer,
    every step. It applies to layers whose class sets `traced_decode`, with a cache that has `decode_inputs`
    (IsoQuantCache: its fused launch keeps its class as the context grows and takes every length as a value;
    SlidingWindowCache: its ring, the same shapes every step), decode graphs on and no expert pager serving the
    layer (whose routing is read on the host mid-layer). The cache's arrays (an IsoQuantCache's codes, norms, fp16
    buffers, rotation and codebook, the step's meta; a ring's keys, values and slot) are the graph's inputs and its
    new buffers its outputs, so the graph, traced once per plan (and by mx.compile per buffer shapes), serves every
    cache of that layer."""
    if x.ndim != 3 or x.shape[1] != 1 or not getattr(layer, "traced_decode", False):
        return None
    inputs = getattr(cache, "decode_inputs", None)
    graphs = layer.__dict__.get("_decode_graphs")
    if inputs is None or graphs is False or _paged(layer):
        return None
    prep = inputs()
    if prep is None:
        return None
    plan, arrays = prep
    extra_arrays, extra_spec = _flatten(extra)
    if graphs is None:
        graphs = layer.__dict__["_decode_graphs"] = {}
    query = getattr(cache, "decode_query", None)  # (shape, dtype, scale) a plan was made for (a ring's: none)
    # a compressed cache's plan is its fused launch, named by its class (`.plan`: a new cache's launch of the same class
    # replays the graph); a ring's is its name
    key = ("decode_layer", getattr(plan, "plan", plan), query, type(cache), extra_spec)
    entry = graphs.get(key)
    if entry is None:
        kept = [k for k in graphs if isinstance(k, tuple) and k[0] == "decode_layer"]
        for k in kept[: max(0, len(kept) - LAYER_GRAPHS_KEPT + 1)]:
            del graphs[k]
        out_spec: list = []  # the layer's output structure, recorded as the graph is traced
        fn = mx.compile(functools.partial(_layer_graph, weakref.proxy(layer), type(cache), plan, query, len(arrays),
                                          extra_spec, out_spec))
        entry = graphs[key] = (fn, out_spec)
    fn, out_spec = entry
    k_buf, v_buf, *out = fn(x, _scalar(cache.offset), *arrays, *extra_arrays)
    cache.decode_commit(k_buf, v_buf)
    return _build(out_spec[0], out)


def _layer_graph(layer: nn.Module, cache_type: type, plan: Any, query: tuple, n_arrays: int, extra_spec: Any,
                 out_spec: list, x: mx.array, offset: mx.array, *inputs: mx.array) -> list[mx.array]:
    kv = _TracedKV(cache_type, plan, query, offset, list(inputs[:n_arrays]))
    extra = _build(extra_spec, list(inputs[n_arrays:]))
    _LAYER_GRAPH.tracing = True  # the layer's decode_graph methods run inside this graph as written
    try:
        out = layer(x, kv, *extra)
    finally:
        _LAYER_GRAPH.tracing = False
    if len(kv.buffers) != 2:
        raise ValueError("decode_layer: the layer did not attend through its cache")
    arrays, spec = _flatten(out)
    out_spec[:] = [spec]
    return [*kv.buffers, *arrays]


def _flatten(obj: Any) -> tuple[list[mx.array], Any]:
    """(the arrays of a nest of tuples, lists, arrays and None, in order; its structure, hashable)."""
    if isinstance(obj, mx.array):
        return [obj], "a"
    if obj is None:
        return [], None
    if isinstance(obj, (tuple, list)):
        arrays, spec = [], []
        for o in obj:
            a, sp = _flatten(o)
            arrays += a
            spec.append(sp)
        return arrays, tuple(spec)
    raise TypeError(f"decode_layer: an argument of type {type(obj).__name__}")


def _build(spec: Any, arrays: list) -> Any:
    """_flatten's nest again from its structure and arrays (consumed from the front)."""
    if spec == "a":
        return arrays.pop(0)
    if spec is None:
        return None
    return tuple(_build(sp, arrays) for sp in spec)


def _paged(layer: nn.Module) -> bool:
    """Whether an expert pager serves one of the layer's routed-expert banks (paged_experts)."""
    switches = layer.__dict__.get("_switches")
    if switches is None:
        switches = layer.__dict__["_switches"] = [m for m in layer.modules() if isinstance(m, SwitchGLU)]
    return any("pager_layer" in m.__dict__ for m in switches)


def set_bank_inputs(module: nn.Module, banks: list) -> None:
    """The expert banks (modules whose arrays the pager rewrites) that `module`'s `reads_banks` graphs take as inputs;
    graphs already traced are dropped."""
    module.__dict__["_bank_inputs"] = list(banks)
    if module.__dict__.get("_decode_graphs"):
        module.__dict__["_decode_graphs"] = None


@functools.lru_cache(maxsize=64)
def _scalar(n: int) -> mx.array:
    # one array a value: every layer of a decode step passes the same offset
    a = mx.array(n, mx.int32)
    mx.eval(a)
    return a


def set_decode_graphs(model: nn.Module, on: bool) -> None:
    """Turn `decode_graph` methods on or off for every module of `model`, dropping graphs already traced (they hold
    the weights they were traced with)."""
    for m in model.modules():
        m.__dict__["_decode_graphs"] = None if on else False


@contextlib.contextmanager
def layers_as_written(model: nn.Module):
    """Within, one-token inputs run every module's Python too (code that hooks a module's calls sees each of them,
    or reads arrays inside them; a paged MoE layer calls its experts' __call__, not the pager's serve/compute); the
    traced graphs and their setting come back after."""
    saved = [(m, m.__dict__.get("_decode_graphs")) for m in model.modules()]
    for m, _ in saved:
        m.__dict__["_decode_graphs"] = False
    try:
        yield
    finally:
        for m, g in saved:
            m.__dict__["_decode_graphs"] = g


LayerCall = Callable[[int, nn.Module, mx.array, Any], mx.array]


class StepResume:
    """A decode step that can run again from one of its layers (the expert pager's speculated steps, which keep the
    layers before the first one that missed an expert): each layer's input as the last run computed it, the first
    layer to run, the layer running now, and what a family carries from layer to layer besides h (`carry`)."""

    def __init__(self) -> None:
        self.inputs: dict[int, mx.array] = {}
        self.start = 0
        self.layer = 0
        self.carry: dict = {}
        self.resumable = False  # set by run_layers' own loop (a pipeline over ranks cannot skip layers)


_RESUME = threading.local()  # the step being built on this thread (a server may build on several)


@contextlib.contextmanager
def resuming(state: StepResume):
    """Within, on this thread, run_layers records each layer's input in `state` and starts at `state.start`."""
    outer = getattr(_RESUME, "state", None)
    _RESUME.state = state
    try:
        yield state
    finally:
        _RESUME.state = outer


def step_resume() -> Optional[StepResume]:
    """The StepResume of the step being built on this thread, if any."""
    return getattr(_RESUME, "state", None)


@contextlib.contextmanager
def settling(fn: Callable[[], None]):
    """Within, on this thread, `settle_step()` calls `fn`: what must happen before anything of the decode step being
    built is evaluated (the expert pager's MoE layer whose experts are not in yet)."""
    outer = getattr(_RESUME, "settle", None)
    _RESUME.settle = fn
    try:
        yield
    finally:
        _RESUME.settle = outer


def settle_step() -> None:
    """Called before an evaluation in the middle of building a decode step (a cache coding its fp16 window in
    chunks): the arrays it evaluates may depend on a MoE layer whose experts the pager has not written yet."""
    fn = getattr(_RESUME, "settle", None)
    if fn is not None:
        fn()


def run_layers(layers: list, h: mx.array, cache: Optional[list] = None, call: Optional[LayerCall] = None) -> mx.array:
    """h through each layer with its cache slot (no cache: every slot None); `call(i, layer, h, cache)` runs
    layer i where a family passes it more than (h, cache). Split over ranks (rq_core.distributed), the layers
    other ranks hold are `Remote` and the pipeline runs this rank's slice between a recv and a send. Within
    `resuming(state)`: layers before state.start are skipped, the first one run takes its recorded input."""
    pipe = _pipeline(layers)
    if pipe is not None:
        return pipe.run(layers, h, cache, call)
    rs = step_resume()
    if rs is not None:
        rs.resumable = True
    for i, (layer, c) in enumerate(zip(layers, cache if cache is not None else [None] * len(layers))):
        if rs is not None:
            if i < rs.start:
                continue
            if i > 0 and i == rs.start:
                h = rs.inputs[i]
            rs.inputs[i], rs.layer = h, i
        if call is not None:
            h = call(i, layer, h, c)
        else:
            out = decode_layer(layer, h, c) if rs is None else None
            h = layer(h, c) if out is None else out
    return h


class Remote(nn.Module):
    """A layer another rank holds: no parameters (so no module walk, evaluation or pager sees its weights);
    the plain attributes `make_cache` reads (window, head dims, block type) come from the emptied layer, so
    every rank builds the same cache list as one process would."""

    def __init__(self, layer: nn.Module, pipeline: Any):
        super().__init__()
        object.__setattr__(self, "_layer", layer)  # outside the module tree
        object.__setattr__(self, "pipeline", pipeline)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return getattr(self.__dict__["_layer"], key)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a layer held by another rank was called")


def _pipeline(layers: list) -> Any:
    # one process: no Remote layer (two isinstance checks a forward pass)
    if layers and isinstance(layers[0], Remote):
        return layers[0].pipeline
    if layers and isinstance(layers[-1], Remote):
        return layers[-1].pipeline
    return None


def lm_logits(lm: nn.Module, h: mx.array, embed: nn.Embedding) -> mx.array:
    """Logits of the final hidden states: `lm`'s lm_head, or the input embedding when tied (no lm_head)."""
    return lm.lm_head(h) if "lm_head" in lm else embed.as_linear(h)


# ------------------------------------------------------------------------------------ routed experts
def _cpu_half_gather_mm(x: mx.array, w: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
    """MLX's CPU gather_mm is float32-only: compute in float32, upcasting only the experts in use
    when few are (decode), else the bank for this call (prefill). Metal/CUDA never come here."""
    if indices.size < w.shape[0]:
        wsel = w[indices.flatten()].astype(mx.float32)  # [n, out, in]
        idx = mx.arange(indices.size, dtype=mx.uint32).reshape(indices.shape)
        y = mx.gather_mm(x.astype(mx.float32), wsel.swapaxes(-1, -2), rhs_indices=idx)
    else:
        y = mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
    return y.astype(x.dtype)


class SwitchLinear(nn.Module):
    """A bank of E linear maps, weight [E, out, in]; x @ W[idx]^T by one mx.gather_mm."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(low=-scale, high=scale, shape=(num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False,
                 lhs_indices: Optional[mx.array] = None) -> mx.array:
        w = self["weight"]
        if w.dtype != mx.float32 and mx.default_device() == mx.cpu:
            x = _cpu_half_gather_mm(x, w, indices, sorted_indices)
        else:
            x = mx.gather_mm(x, w.swapaxes(-1, -2), lhs_indices=lhs_indices, rhs_indices=indices,
                             sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_: Any) -> "QuantizedSwitchLinear":
        E, out, inp = self.weight.shape
        ql = QuantizedSwitchLinear(inp, out, E, bias=False, group_size=group_size, bits=bits, mode=mode,
                                   weight=self.weight)
        if "bias" in self:
            ql.bias = self.bias
        return ql


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with mx.quantize'd weights; one mx.gather_qmm per call (or, `dense`, the bank dequantized)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False,
                 group_size: int = 64, bits: int = 4, mode: str = "affine", weight: Optional[mx.array] = None):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        if weight is None:
            weight = mx.zeros((num_experts, output_dims, input_dims))
        self.weight, self.scales, *b = mx.quantize(weight, group_size, bits, mode=mode)
        self.biases = b[0] if b else None
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        self.freeze()

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def dense_bytes(self) -> int:
        """Bytes of the bank dequantized (affine: in its scales' dtype)."""
        E, out, _ = self["weight"].shape
        return E * out * self["scales"].shape[-1] * self.group_size * self["scales"].dtype.size

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False,
                 lhs_indices: Optional[mx.array] = None, dense: bool = False) -> mx.array:
        """`dense`: the whole bank dequantized and one mx.gather_mm, evaluated before it returns
        (SwitchGLU.dense_prompt: queued lazily, every layer's banks of a prompt chunk would be dequantized ahead of
        their matmuls, or held until the device ran them, all in memory at once)."""
        if dense:
            w = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size,
                              bits=self.bits, mode=self.mode)
            x = mx.gather_mm(x, w.swapaxes(-1, -2), lhs_indices=lhs_indices, rhs_indices=indices,
                             sorted_indices=sorted_indices)
            mx.eval(x)
        else:
            x = mx.gather_qmm(x, self["weight"], self["scales"], self.get("biases"), lhs_indices=lhs_indices,
                              rhs_indices=indices, transpose=True, group_size=self.group_size, bits=self.bits,
                              mode=self.mode, sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x


_TOKEN_ROWS: dict[tuple, tuple[mx.array, mx.array]] = {}


def _token_rows(shape: tuple) -> tuple[mx.array, mx.array]:
    """For indices of `shape` [..., k] (fewer than 64 pairs): the x row of each (token, k) pair in the experts'
    first projections (the token's) and in the last (the pair's own), contiguous uint32 arrays of `shape`, made
    and evaluated once a shape (also when first asked inside a trace: they depend on no input)."""
    rows = _TOKEN_ROWS.get(shape)
    if rows is None:
        n = math.prod(shape)
        tokens = mx.arange(n // shape[-1], dtype=mx.uint32).reshape(*shape[:-1], 1)
        rows = (mx.contiguous(mx.broadcast_to(tokens, shape)), mx.arange(n, dtype=mx.uint32).reshape(shape))
        mx.eval(rows)
        _TOKEN_ROWS[shape] = rows
    return rows


def _gather_sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    # Group token copies by expert so each expert's rows are contiguous (faster gather for prefill).
    *_, M = indices.shape
    flat = indices.flatten()
    order = mx.argsort(flat)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // M], flat[order], inv_order


# SwitchGLU.dense_prompt: token copies from which a bank is dequantized; the measured gather_qmm costs ~1 us a row a
# projection and dequantizing ~0.4 ms, so it pays from ~400 rows: 1,024 leaves room for the syncs and other shapes
DENSE_PROMPT_ROWS = 1024
DENSE_PROMPT_BYTES = 512 << 20  # the largest bank dequantized whole (one at a time: planner.dense_prompt_bytes)


def dense_prompt_device() -> bool:
    """Whether prompts' experts may run dequantized here (SwitchGLU.dense_prompt): MLX's CUDA backend, whose gather_qmm
    is the slow part of a prompt; Metal's is not measured slow, the CPU's gather_mm is float32-only."""
    return mx.default_device() != mx.cpu and mx.cuda.is_available()


class SwitchGLU(nn.Module):
    """Routed experts y_e = down(act(gate x) * up x), stacked per layer.

    `activation(gate, up)` combines the two projections (default SwiGLU). With `gated=False` there is no
    gate_proj and `activation(up)` is applied alone (Nemotron-H's ReLU² experts).
    The expert pager swaps the banks (`gate_proj`, `up_proj`, `down_proj`) behind this class.
    """

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int,
                 activation: Optional[Callable] = None, bias: bool = False, gated: bool = True):
        super().__init__()
        self.gated = gated
        if gated:
            self.gate_proj = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts, bias=bias)
        self.activation = activation or (swiglu if gated else relu2)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., D], indices [..., k] → [..., k, D] (one output per selected expert)."""
        return self.compute(x, indices)

    def compute(self, x: mx.array, indices: mx.array) -> mx.array:
        """What __call__ computes, with `indices` into the banks as they are (the expert pager's slots, once it has
        made the experts resident; the pager takes over __call__)."""
        x = mx.expand_dims(x, (-2, -3))
        if indices.size >= 64:  # a prompt: token copies grouped by expert
            x, idx, inv_order = _gather_sort(x, indices)
            x = self.compute_grouped(x, idx)
            return mx.unflatten(x[inv_order], 0, indices.shape).squeeze(-2)
        # the rows of x each output reads, as constants: without them every gather builds (and on a GPU launches)
        # an arange, and a copy where it broadcasts, a projection
        tokens, pairs = _token_rows(indices.shape)
        up = self.up_proj(x, indices, lhs_indices=tokens)
        h = self.activation(self.gate_proj(x, indices, lhs_indices=tokens), up) if self.gated else self.activation(up)
        return self.down_proj(h, indices, lhs_indices=pairs).squeeze(-2)


    def compute_grouped(self, rows: mx.array, idx: mx.array) -> mx.array:
        """Token copies rows [R, 1, D] grouped by expert, idx [R] (non-decreasing) into the banks: [R, 1, D], as a
        prompt's rows are computed (the expert pager's prefill passes compute each pass's rows alone through it)."""
        if not self.dense_prompt(rows.shape[0]):
            up = self.up_proj(rows, idx, sorted_indices=True)
            h = self.activation(self.gate_proj(rows, idx, sorted_indices=True), up) if self.gated \
                else self.activation(up)
            return self.down_proj(h, idx, sorted_indices=True)
        # each projection evaluated before the next bank is dequantized: one bank in memory (a sync a projection, a
        # prompt chunk's layer being milliseconds of device time)
        up = self.up_proj(rows, idx, sorted_indices=True, dense=True)
        h = self.activation(self.gate_proj(rows, idx, sorted_indices=True, dense=True), up) if self.gated \
            else self.activation(up)
        return self.down_proj(h, idx, sorted_indices=True, dense=True)

    def dense_prompt(self, rows: int) -> bool:
        """Whether a prompt's `rows` token copies go through each quantized bank dequantized whole and one
        mx.gather_mm, a bank at a time: on an NVIDIA GPU (dense_prompt_device), from DENSE_PROMPT_ROWS rows, for affine
        banks of at most DENSE_PROMPT_BYTES dequantized that no expert pager serves (its slot banks are planned
        without that room).
        MLX's CUDA gather_qmm reads the codes again for every row: H200, Qwen3-30B-A3B's experts at 2 bits, a layer's
        three projections for 512 tokens took 11.7 ms, dequantized 3.2 ms (1.2 of it dequantizing); for 2,048 tokens
        45.6 against 3.7 ms."""
        if rows < DENSE_PROMPT_ROWS or not dense_prompt_device() or "pager_layer" in self.__dict__:
            return False
        banks = [self.up_proj, self.down_proj] + ([self.gate_proj] if self.gated else [])
        return all(isinstance(b, QuantizedSwitchLinear) and b.mode == "affine" and b.dense_bytes <= DENSE_PROMPT_BYTES
                   for b in banks)


def dense_prompt_bank_bytes(model: nn.Module, rows: int) -> int:
    """The largest bank a MoE layer of `model` holds dequantized for a prompt chunk of `rows` token copies
    (SwitchGLU.dense_prompt), 0 where no layer runs dense."""
    return max((b.dense_bytes for m in model.modules() if isinstance(m, SwitchGLU) and m.dense_prompt(rows)
                for b in (m.up_proj, m.down_proj) + ((m.gate_proj,) if m.gated else ())), default=0)


def paged_experts(switch: nn.Module, x: mx.array) -> Any:
    """The expert pager's layer serving `switch`'s banks when x [B, L, D] is one token of one sequence of a decode
    step the pager runs (ExpertPager.decode_step) and the layer can serve a token's experts at once, with decode graphs
    on; else None (the layer runs as written: a paged `switch` call reads its routing itself, in passes where it has
    fewer slots than experts to serve, and evaluates its output). A paged decode
    step runs a MoE layer as two graphs: `serve(indices)` maps the chosen experts to their slots through the device's
    table, which the second graph's `compute` reads, and the pager reads the routing and writes the missing experts in
    (the layer's one host sync) before that graph runs: at the next MoE layer's serve, or before the step is queued."""
    layer = switch.__dict__.get("pager_layer")
    if layer is None or x.shape[0] != 1 or x.shape[1] != 1 or switch.__dict__.get("_decode_graphs") is False:
        return None
    return layer if layer.serves_a_token() and layer.stepping() else None


# ------------------------------------------------------------------------------------------ routing
def topk_indices(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest scores along the last axis (unordered; of equal scores the first, as mlx-lm)."""
    # integer indices carry no gradient: no stop_gradient node (each is one more op a layer to replay and run)
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def route_softmax_topk(logits: mx.array, k: int, norm_topk_prob: bool) -> tuple[mx.array, mx.array]:
    """Softmax over all experts, pick top-k, optionally renormalise: (indices, weights). Not renormalised, the weights
    are float32; renormalised, they come in the logits' dtype (computed in float32, rounded once), as transformers
    casts them before use."""
    if norm_topk_prob:
        # the renormalised top-k of a softmax is the softmax of the top-k logits, and softmax keeps the logits'
        # order: four kernels a MoE layer fewer (two casts, the sum and the divide)
        inds = topk_indices(logits, k)
        return inds, mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    inds = topk_indices(probs, k)
    return inds, mx.take_along_axis(probs, inds, axis=-1)


def route_sigmoid_group_topk(logits: mx.array, k: int, *, correction_bias: Optional[mx.array] = None,
                             n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                             routed_scaling_factor: float = 1.0) -> tuple[mx.array, mx.array]:
    """DeepSeek-V3 / Nemotron-H routing: sigmoid scores, bias only for choosing, group top-k."""
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores if correction_bias is None else scores + correction_bias.astype(mx.float32)
    if n_group > 1:
        E = choice.shape[-1]
        g = choice.reshape(*choice.shape[:-1], n_group, E // n_group)
        group_scores = mx.sum(mx.sort(g, axis=-1)[..., -2:], axis=-1)  # top-2 per group
        drop = n_group - topk_group
        if drop > 0:
            low = mx.argpartition(group_scores, kth=drop - 1, axis=-1)[..., :drop]
            g = mx.put_along_axis(g, mx.expand_dims(low, -1), mx.array(-mx.inf, g.dtype), axis=-2)  # -inf: biased scores may be < 0
        choice = g.reshape(*choice.shape)
    inds = topk_indices(choice, k)
    w = mx.take_along_axis(scores, inds, axis=-1)
    if norm_topk_prob:  # transformers normalises for k = 1 too (weight → 1)
        w = w / (mx.sum(w, axis=-1, keepdims=True) + 1e-20)
    return inds, w * routed_scaling_factor


def combine_experts(y: mx.array, weights: mx.array) -> mx.array:
    """Sum the k expert outputs [..., k, D] weighted by [..., k] (weights cast to y's dtype): one matmul, where a
    product and a reduction were two kernels."""
    return (weights[..., None, :].astype(y.dtype) @ y).squeeze(-2)


# ------------------------------------------------------------------------------------------ caches
class SlidingWindowCache:
    """fp16 cache for sliding-window layers: a ring of `window` slots, the token at position p in slot p % window.

    Follows the KVCache protocol (`attend`, `end_prefill`, `trim`, byte counts) and a traced decode step's
    (`decode_inputs`, `traced_attend`, `decode_commit`: decode_layer). A query at position i sees
    keys j with i - window < j <= i (transformers' sliding-window semantics). Decode writes one slot in place
    and attends over the ring as is (key order does not matter to softmax), so a token costs no copy of the
    window. A prefill chunk is attended in time order behind the ring's tokens, masked, then its newest
    `window` tokens are rolled into their slots.
    """

    def __init__(self, window: int) -> None:
        self.window = int(window)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.valid = 0  # newest tokens present (≤ window; fewer after trim)
        self.decoded = False  # a decode step has attended as written: the next ones may be traced (decode_inputs)

    def _in_time_order(self) -> tuple[mx.array, mx.array]:
        W, n, s = self.window, self.valid, self.offset % self.window
        idx = (mx.arange(s - n, s) % W).astype(mx.int32)  # slots of positions offset-n .. offset-1
        return mx.take(self.keys, idx, axis=2), mx.take(self.values, idx, axis=2)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
               mask: Mask = None) -> mx.array:
        W, L = self.window, keys.shape[2]
        if L == 1 and self.keys is not None:
            self.decoded = True
            slot = self.offset % W
            self.keys[..., slot:slot + 1, :] = keys
            self.values[..., slot:slot + 1, :] = values
            self.offset += 1
            self.valid = min(self.valid + 1, W)
            m = None
            if self.valid < W:  # only slots holding the newest `valid` positions are live
                age = (slot - mx.arange(W)) % W
                m = age < self.valid
            return mx.fast.scaled_dot_product_attention(queries, self.keys, self.values, scale=scale, mask=m)
        if self.valid:
            pk, pv = self._in_time_order()
            k, v = mx.concatenate([pk, keys], axis=2), mx.concatenate([pv, values], axis=2)
        else:
            k, v = keys, values
        T = k.shape[2]
        start = self.offset + L - T  # position of k[..., 0, :]
        q_pos = mx.arange(self.offset, self.offset + L)[:, None]
        k_pos = mx.arange(start, start + T)[None]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - W)
        out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=allowed)
        n = min(T, W)
        tail_k, tail_v = k[..., T - n:, :], v[..., T - n:, :]
        end = self.offset + L  # one past the newest position
        if n < W:  # pad to the full ring; tail positions end-n .. end-1 land in their slots after the roll
            pad = [(0, 0)] * 2 + [(0, W - n), (0, 0)]
            tail_k, tail_v = mx.pad(tail_k, pad), mx.pad(tail_v, pad)
        shift = (end - n) % W
        self.keys, self.values = mx.roll(tail_k, shift, axis=2), mx.roll(tail_v, shift, axis=2)
        self.offset, self.valid = end, n
        return out

    # -- a decode step's attention inside its layer's traced graph (decode_layer) --
    def decode_inputs(self) -> tuple[str, list[mx.array]] | None:
        """(plan, [keys, values, the new token's slot, and while the ring fills the count of live slots after it]): a
        decode step writes its slot and attends over the ring, the same shapes every step; "full" unmasked, "filling"
        with the mask of the live slots. None until a decode step has attended as written (what a layer does once on
        its first call stays out of the trace, as decode_graph keeps it)."""
        if self.keys is None or not self.decoded:
            return None
        arrays = [self.keys, self.values, row_index(self.offset % self.window)]
        if self.valid >= self.window:
            return "full", arrays
        return "filling", [*arrays, row_index(self.valid + 1)]

    @staticmethod
    def traced_attend(plan: str, arrays: list[mx.array], queries: mx.array, keys: mx.array, values: mx.array, *,
                      scale: float) -> tuple[mx.array, mx.array, mx.array]:
        """Inside a traced graph: the new K/V written to their slot, attention over the ring → (output, the new
        key and value rings)."""
        ring_k, ring_v, slot, *live = arrays
        ring_k = mx.slice_update(ring_k, keys.astype(ring_k.dtype), slot, axes=(2,))
        ring_v = mx.slice_update(ring_v, values.astype(ring_v.dtype), slot, axes=(2,))
        mask = None
        if plan == "filling":  # a slot is live while its age (steps since it was written) is below the valid count
            mask = (slot - mx.arange(ring_k.shape[2], dtype=mx.int32)) % ring_k.shape[2] < live[0]
        return mx.fast.scaled_dot_product_attention(queries, ring_k, ring_v, scale=scale, mask=mask), ring_k, ring_v

    def decode_commit(self, keys: mx.array, values: mx.array) -> None:
        """The rings a traced step wrote its token into."""
        self.keys, self.values = keys, values
        self.offset += 1
        self.valid = min(self.valid + 1, self.window)

    def end_prefill(self) -> None:
        pass

    def trim(self, n: int) -> int:
        """Drop up to n newest tokens, only as many as keep the next query's window complete (evicted
        tokens cannot come back): all of them while nothing was evicted, else valid - (window - 1)."""
        allowed = self.valid if self.offset == self.valid else max(0, self.valid - (self.window - 1))
        n = max(0, min(n, allowed))
        self.offset -= n
        self.valid -= n
        return n

    def mark(self) -> Callable[[], None]:
        # a decode step writes the slot of the position it adds; run again, it writes that slot again, and the
        # token it overwrote was outside every later query's window
        saved = self.keys, self.values, self.offset, self.valid

        def undo() -> None:
            self.keys, self.values, self.offset, self.valid = saved
        return undo

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return (self.keys[..., :1, :].nbytes + self.values[..., :1, :].nbytes) * self.valid

    @property
    def fp16_nbytes(self) -> int:
        if self.keys is None:
            return 0
        B, H, _, D = self.keys.shape
        return 2 * B * H * self.valid * (D + self.values.shape[3])


def attention_mask(L: int) -> Mask:
    """The mask argument models pass to `cache.attend` for L new tokens."""
    return "causal" if L > 1 else None


def attention_cache(attn: Any, kv: KVSettings, layer: int) -> Any:
    """The cache of attention layer `layer` (`attn` has window, n_kv_heads, head_dim): an fp16 window cache
    for a sliding layer, or, with kv.max_kv_size, one of that many tokens; else one of the KV mode `kv` chooses."""
    if attn.window is not None:
        return SlidingWindowCache(attn.window)
    if kv.max_kv_size is not None:
        if kv.mode != "fp16" or kv.max_kv_size < 1:
            from rq_core.errors import RQError

            raise RQError(f"max_kv_size = {kv.max_kv_size} bounds an fp16 KV cache of >= 1 token (KV mode {kv.mode})")
        return SlidingWindowCache(kv.max_kv_size)
    return make_kv_cache(kv, layer=layer, n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim)


def attend(cache: Any, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
           window: Optional[int] = None) -> mx.array:
    """Attention of the new tokens: through the layer's cache, or (cache None, e.g. training) directly."""
    L = queries.shape[2]
    if cache is not None:
        return cache.attend(queries, keys, values, scale=scale, mask=attention_mask(L))
    mask: Mask = attention_mask(L)
    if window is not None and L > 1:
        pos = mx.arange(L)
        mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - window)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def stack_experts(weights: dict[str, mx.array], prefix: str, num_experts: int,
                  names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj"),
                  dst: str = "switch_mlp") -> None:
    """Rewrite one MoE block's expert weights in place into `<prefix>.<dst>.<name>.weight` [E, out, in].

    Handles the hub layout (`<prefix>.experts.<e>.<name>.weight`) and transformers 5's fused layout
    (`<prefix>.experts.gate_up_proj` [E, 2I, D] — gate rows first — and `<prefix>.experts.down_proj`
    [E, D, I], with or without a `.weight` suffix). Already-stacked names pass through.
    """
    for n in names:
        k0 = f"{prefix}.experts.0.{n}.weight"
        if k0 in weights:
            parts = [weights.pop(f"{prefix}.experts.{e}.{n}.weight") for e in range(num_experts)]
            weights[f"{prefix}.{dst}.{n}.weight"] = mx.stack(parts)
            for suffix in ("bias",):
                kb = f"{prefix}.experts.0.{n}.{suffix}"
                if kb in weights:
                    bs = [weights.pop(f"{prefix}.experts.{e}.{n}.{suffix}") for e in range(num_experts)]
                    weights[f"{prefix}.{dst}.{n}.{suffix}"] = mx.stack(bs)
    for suf in ("", ".weight"):
        fused = weights.pop(f"{prefix}.experts.gate_up_proj{suf}", None)
        if fused is not None:
            half = fused.shape[1] // 2
            weights[f"{prefix}.{dst}.gate_proj.weight"] = fused[:, :half]
            weights[f"{prefix}.{dst}.up_proj.weight"] = fused[:, half:]
        for n in names:
            w = weights.pop(f"{prefix}.experts.{n}{suf}", None)
            if w is not None:
                weights[f"{prefix}.{dst}.{n}.weight"] = w
