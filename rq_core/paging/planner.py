"""Memory planner: from a config and a recipe, bytes by role, resident bytes, KV bytes per token,
bytes per expert, and how many expert slots per MoE layer fit a memory budget. Reads no weights:
tensor shapes come from the family's model built lazily (MLX arrays are never evaluated).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from rq_core.errors import RQError
from rq_core.models import text_config
from rq_core.quant.recipe import Recipe, RoleSpec
from rq_core.quant.roles import NEVER, ROLES, ROUTED_EXPERT, family_of, role_of

DTYPE_BYTES = 2  # bf16/fp16 weights, scales and biases


def dtype_bytes(config: dict) -> int:
    """Bytes per element of the checkpoint's unquantized tensors (config `dtype` / `torch_dtype`)."""
    dt = str(config.get("dtype") or config.get("torch_dtype") or text_config(config).get("dtype") or "bfloat16")
    return 4 if "32" in dt else 2


def tensor_bytes(shape: tuple[int, ...], spec: Optional[RoleSpec], dbytes: int = DTYPE_BYTES) -> int:
    """Bytes of one weight stored as `spec` says (mx.quantize affine: packed codes + scale + bias per group)."""
    n = 1
    for s in shape:
        n *= s
    if spec is None or spec.bits is None or len(shape) < 2:
        return n * dbytes
    return n * spec.bits // 8 + (n // spec.group_size) * 2 * dbytes


def param_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the family's model for this config, without materialising anything.
    Weights of modules that cannot be quantized (no `to_quantized`) are marked by a trailing '!'."""
    from mlx.utils import tree_flatten

    from rq_core.models import get_model_module

    module = get_model_module(config.get("model_type"))
    model = module.Model(module.ModelArgs.from_dict(config))
    qmods = {p for p, m in model.named_modules() if hasattr(m, "to_quantized")}
    return {(k if k.rsplit(".", 1)[0] in qmods else k + "!"): tuple(v.shape)
            for k, v in tree_flatten(model.parameters())}


def quantizable(name: str, shape: tuple[int, ...], role: str) -> bool:
    """Weights of Linear / Embedding / stacked-expert modules (2-D or 3-D `.weight`) get quantized."""
    return role != NEVER and name.endswith(".weight") and len(shape) in (2, 3)


@dataclass
class Plan:
    model_type: str
    recipe: str
    role_params: dict[str, int]
    role_bytes: dict[str, int]
    total_bytes: int  # every weight, as quantized
    resident_bytes: int  # everything but the routed experts
    moe_layers: int
    experts_per_layer: int
    top_k: int
    bytes_per_expert: int  # one expert of one layer (all its projections)
    routed_bytes: int  # all routed experts
    kv_bytes_per_token: int  # full-attention layers, in the recipe's KV mode
    kv_fixed_bytes: int  # sliding-window caches at full window + Mamba states
    context: int
    kv_bytes: int  # at `context` tokens
    prefill_fp16_bytes: int  # a compressing cache's fp16 K/V while a prompt is prefilled (the prompt, or kv.prefill_fp16
    # tokens and one layer's decoded context)
    activation_bytes: int  # working memory reserved for one prefill chunk
    budget_bytes: Optional[int]
    slots_per_layer: int  # expert slots per MoE layer (= experts_per_layer when all fit)
    expert_fraction: float  # slots / experts
    fits: bool
    planned_peak_bytes: int  # resident + slots + KV + the prefill's fp16 K/V + activations
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _moe_info(config: dict) -> tuple[int, int, int]:
    """(number of MoE layers, experts per layer, top-k)."""
    fam, tc = family_of(config), text_config(config)
    if fam == "nemotron_h":
        pat = tc.get("hybrid_override_pattern", "")
        return pat.count("E"), tc.get("n_routed_experts", 0), tc.get("num_experts_per_tok", 0)
    if fam == "gemma4":
        n = tc["num_hidden_layers"] if tc.get("enable_moe_block", True) else 0
        return n, tc.get("num_experts", 0), tc.get("top_k_experts", 0)
    E = tc.get("num_experts", 0)
    if not E:
        return 0, 0, 0
    step = tc.get("decoder_sparse_step", 1) or 1
    only = set(tc.get("mlp_only_layers") or [])
    n = sum(1 for i in range(tc["num_hidden_layers"]) if i not in only and (i + 1) % step == 0)
    return n, E, tc.get("num_experts_per_tok", 0)


def kv_bytes(config: dict, kv_mode: str = "fp16", kv_bits: int = 3, edge_layers: int = 0,
             edge_bits: int = 4, act_bytes: int = DTYPE_BYTES) -> tuple[int, int]:
    """(bytes per token of context over full-attention layers, fixed bytes of sliding/Mamba caches). A compressed
    mode's first and last `edge_layers` full-attention layers hold `edge_bits` codes (kv.edge_layers). Plain
    caches hold the model's activation dtype: `act_bytes` per element (4 for a model computing in float32)."""
    fam, tc = family_of(config), text_config(config)

    def per_vec(d: int, bits: int) -> int:
        if kv_mode == "fp16":
            return act_bytes * d
        return -(-d * bits // 32) * 4 + 2  # packed codes (uint32 words) + fp16 norm

    attn: list[tuple[int, int]] = []  # (kv heads, head dim) of each full-attention layer, in order
    fixed = 0
    if fam == "nemotron_h":
        pat = tc.get("hybrid_override_pattern", "")
        hd = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
        attn = [(tc["num_key_value_heads"], hd)] * pat.count("*")
        nh, mhd, st = tc["mamba_num_heads"], tc["mamba_head_dim"], tc["ssm_state_size"]
        conv_dim = nh * mhd + 2 * tc["n_groups"] * st
        fixed = pat.count("M") * (nh * mhd * st * 4 + conv_dim * (tc["conv_kernel"] - 1) * DTYPE_BYTES)
    elif fam == "gemma4":
        types = tc.get("layer_types") or []
        window = tc.get("sliding_window") or 0
        hd, ghd = tc["head_dim"], tc.get("global_head_dim") or tc["head_dim"]
        gkv = tc.get("num_global_key_value_heads") or tc["num_key_value_heads"]
        for t in types:
            if t == "full_attention":
                attn.append((gkv, ghd))
            else:
                fixed += window * 2 * tc["num_key_value_heads"] * act_bytes * hd
    else:
        hd = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
        types = tc.get("layer_types") or ["full_attention"] * tc["num_hidden_layers"]
        for t in types:
            if t == "sliding_attention" and tc.get("sliding_window"):
                fixed += tc["sliding_window"] * 2 * tc["num_key_value_heads"] * act_bytes * hd
            else:
                attn.append((tc["num_key_value_heads"], hd))
    n = len(attn)
    edge = set(range(min(edge_layers, n))) | set(range(max(n - edge_layers, 0), n))
    per_tok = sum(2 * h * per_vec(d, edge_bits if i in edge else kv_bits) for i, (h, d) in enumerate(attn))
    return per_tok, fixed


def layer_fp16_bytes(config: dict, act_bytes: int = DTYPE_BYTES) -> int:
    """Bytes per token of one full-attention layer's K and V in fp16 (the layers share one shape in every family);
    `act_bytes` per element for a model computing in another dtype."""
    fam, tc = family_of(config), text_config(config)
    hd = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    if fam == "gemma4":
        return 2 * (tc.get("num_global_key_value_heads") or tc["num_key_value_heads"]) * act_bytes * (
            tc.get("global_head_dim") or hd)
    return 2 * tc["num_key_value_heads"] * act_bytes * hd


def prefill_fp16_bytes(config: dict, kv_mode: str, context: int, prefill_fp16: Optional[int] = None,
                       prefill_chunk: int = 512, act_bytes: int = DTYPE_BYTES) -> int:
    """A compressing cache's fp16 K/V while a prompt of `context` tokens is prefilled: the whole prompt's (it attends to
    itself exactly until the prefill ends), or with kv.prefill_fp16 that many tokens (at least a chunk) and the K/V
    of the context at 2 bytes of the layers whose decoded attention may be alive at once: the one waited for and
    IsoQuantCache.prefill_inflight queued ahead of it (dispatch._attend_decoded). 0 for an fp16 cache (its K/V is the
    KV line)."""
    from rq_core.cache.kv_cache import IsoQuantCache

    if kv_mode == "fp16":
        return 0
    held = context if prefill_fp16 is None else min(context, max(prefill_fp16, prefill_chunk))
    pre = kv_bytes(config, "fp16", act_bytes=act_bytes)[0] * cache_tokens(held)
    if held < context:
        pre += (1 + max(0, IsoQuantCache.prefill_inflight)) * layer_fp16_bytes(config, act_bytes) * \
            cache_tokens(context)
    return pre


def cache_tokens(context: int, kv_mode: str = "fp16") -> int:
    """Tokens the KV caches hold room for at `context`: they grow in steps of 256 (kv_cache.FP16Cache.step); a
    compressing cache's packed buffers, made as the prefill ends or while decoding, with room for more
    (IsoQuantCache.packed_rows)."""
    from rq_core.cache.kv_cache import FP16Cache, IsoQuantCache

    if kv_mode != "fp16" and context > 0:
        return IsoQuantCache.packed_rows(context)
    step = FP16Cache.step
    return -(-max(context, 0) // step) * step


def activation_bytes(config: dict, chunk: int) -> int:
    """A working-memory reserve for one prefill chunk: logits (fp32) and a few hidden-sized buffers
    per token, plus the routed experts' intermediate activations."""
    tc = text_config(config)
    V, H = tc["vocab_size"], tc["hidden_size"]
    _, _, k = _moe_info(config)
    inter = max(tc.get("moe_intermediate_size") or 0, 1) * max(k, 1)
    dense = max(tc.get("intermediate_size") or 0, tc.get("moe_shared_expert_intermediate_size") or 0,
                tc.get("shared_expert_intermediate_size") or 0)
    return chunk * 4 * (V + 16 * H + 3 * inter + 3 * dense)


def dense_prompt_bytes(routed_shapes: Iterable[tuple[int, ...]], top_k: int, chunk: int, dbytes: int) -> int:
    """The routed-expert bank a prompt chunk's MoE layer holds dequantized on an NVIDIA GPU (models.base.SwitchGLU.
    dense_prompt: one bank at a time, experts all resident), or 0 where that does not apply."""
    from rq_core.models.base import DENSE_PROMPT_BYTES, DENSE_PROMPT_ROWS, dense_prompt_device

    if chunk * top_k < DENSE_PROMPT_ROWS or not dense_prompt_device():
        return 0
    # a layer runs dense when its banks fit the bound (the banks of a layer are of one size in every family)
    banks = (math.prod(shape) * dbytes for shape in routed_shapes)
    return max((b for b in banks if b <= DENSE_PROMPT_BYTES), default=0)


def plan(config: dict, recipe: Recipe, *, budget: Optional[int] = None, context: Optional[int] = None,
         prefill_chunk: int = 512, shapes: Optional[dict[str, tuple[int, ...]]] = None) -> Plan:
    """What the recipe makes of this model and what fits `budget` bytes (None: the recipe's budget)."""
    from rq_core.quant.recipe import parse_size

    fam = family_of(config)
    if recipe.family and recipe.family != fam:
        raise RQError(f"recipe {recipe.name!r} is for {recipe.family} models, this model is {fam}")
    shapes = shapes if shapes is not None else param_shapes(config)
    role_params = {r: 0 for r in ROLES + (NEVER,)}
    role_bytes = {r: 0 for r in ROLES + (NEVER,)}
    routed: dict[str, tuple[int, ...]] = {}
    db = dtype_bytes(config)
    for name, shape in shapes.items():
        name = name.rstrip("!") if name.endswith("!") else name
        role = role_of(name, config)
        n = 1
        for s in shape:
            n *= s
        role_params[role] += n
        spec = recipe.roles.get(role) if quantizable(name, shape, role) and name in shapes else None
        role_bytes[role] += tensor_bytes(shape, spec, db)
        if role == ROUTED_EXPERT:
            routed[name] = shape
    n_moe, E, k = _moe_info(config)
    routed_bytes = role_bytes[ROUTED_EXPERT]
    per_expert = routed_bytes // max(n_moe * E, 1) if n_moe else 0
    resident = sum(role_bytes.values()) - routed_bytes
    per_tok, fixed = kv_bytes(config, recipe.kv.mode, recipe.kv.bits, recipe.kv.edge_layers, recipe.kv.edge_bits)
    ctx = recipe.pager.context if context is None else context
    kvb = per_tok * cache_tokens(ctx, recipe.kv.mode) + fixed
    pre = prefill_fp16_bytes(config, recipe.kv.mode, ctx, recipe.kv.prefill_fp16, prefill_chunk)
    act = activation_bytes(config, min(prefill_chunk, max(ctx, 1)))
    if budget is None and recipe.pager.memory_budget is not None:
        budget = parse_size(str(recipe.pager.memory_budget), "memory budget")
    notes: list[str] = []
    if budget is None:  # no pager: a prompt chunk's experts may run dequantized
        act += dense_prompt_bytes(routed.values(), k, min(prefill_chunk, max(ctx, 1)), db)
    if budget is None or not n_moe:
        slots = E
        fits = budget is None or resident + routed_bytes + kvb + pre + act <= budget
    else:
        free = budget - resident - kvb - pre - act
        slots = max(0, min(E, free // (n_moe * per_expert))) if per_expert else E
        fits = slots >= k
        if not fits:
            notes.append(f"budget leaves {max(free, 0)} bytes for experts: fewer than top-k={k} slots per layer")
    peak = resident + n_moe * slots * per_expert + kvb + pre + act
    return Plan(model_type=fam, recipe=recipe.name, role_params=role_params, role_bytes=role_bytes,
                total_bytes=resident + routed_bytes, resident_bytes=resident, moe_layers=n_moe,
                experts_per_layer=E, top_k=k, bytes_per_expert=per_expert, routed_bytes=routed_bytes,
                kv_bytes_per_token=per_tok, kv_fixed_bytes=fixed, context=ctx, kv_bytes=kvb, prefill_fp16_bytes=pre,
                activation_bytes=act, budget_bytes=budget, slots_per_layer=int(slots),
                expert_fraction=(slots / E) if E else 1.0, fits=bool(fits), planned_peak_bytes=int(peak),
                notes=notes)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"  # pragma: no cover


def render(p: Plan) -> "Any":
    """A rich Table of the plan."""
    from rich.table import Table

    t = Table(title=f"plan: {p.model_type} with recipe {p.recipe}", show_header=True)
    t.add_column("role")
    t.add_column("params", justify="right")
    t.add_column("bytes", justify="right")
    for r in ROLES + (NEVER,):
        if p.role_params[r]:
            t.add_row(r, f"{p.role_params[r]:,}", fmt_bytes(p.role_bytes[r]))
    t.add_row("resident (non-routed)", "", fmt_bytes(p.resident_bytes))
    t.add_row(f"per expert ({p.moe_layers} MoE layers x {p.experts_per_layer} experts, top-{p.top_k})", "",
              fmt_bytes(p.bytes_per_expert))
    t.add_row("KV per token", "", fmt_bytes(p.kv_bytes_per_token))
    t.add_row(f"KV at {p.context} tokens (+ fixed caches)", "", fmt_bytes(p.kv_bytes))
    if p.prefill_fp16_bytes:
        t.add_row("prompt K/V in fp16 while prefilling", "", fmt_bytes(p.prefill_fp16_bytes))
    t.add_row("activation reserve", "", fmt_bytes(p.activation_bytes))
    if p.budget_bytes is not None:
        t.add_row("budget", "", fmt_bytes(p.budget_bytes))
    t.add_row("expert slots per layer", "", f"{p.slots_per_layer} / {p.experts_per_layer} "
                                            f"({100 * p.expert_fraction:.0f}%)")
    t.add_row("planned peak", "", fmt_bytes(p.planned_peak_bytes))
    t.add_row("fits", "", "yes" if p.fits else "NO")
    if p.notes:
        t.caption = "\n".join(p.notes)
    return t
