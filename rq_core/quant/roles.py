"""Every tensor of a checkpoint gets a role, from its name and the model's structure.

Names may be Hugging Face checkpoint names (`model.layers.3.mlp.experts.7.up_proj.weight`) or
parameter names after `sanitize` (`model.layers.3.mlp.switch_mlp.up_proj.weight`, mlx-lm's
convention): both map to the same role, so the planner, quantizer and pager agree.
"""

from __future__ import annotations

import re

from rq_core.errors import RQError
from rq_core.models import text_config

# Roles a recipe can set precision for. NEVER is for tensors that stay in full precision.
ATTENTION = "attention"
DENSE_MLP = "dense_mlp"
MAMBA = "mamba"
ROUTED_EXPERT = "routed_expert"
SHARED_EXPERT = "shared_expert"
ROUTER = "router"  # the router and the shared-expert gate
EMBEDDINGS = "embeddings"
LM_HEAD = "lm_head"
NEVER = "never"

ROLES = (ATTENTION, DENSE_MLP, MAMBA, ROUTED_EXPERT, SHARED_EXPERT, ROUTER, EMBEDDINGS, LM_HEAD)
FAMILIES = ("qwen3_moe", "qwen2_moe", "nemotron_h", "gemma4")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Never quantized, whatever the family: norms, SSM parameters, biases, scale vectors.
_NEVER = re.compile(
    r"(norm|layernorm)[^.]*\.(weight|bias)$|\.A_log$|\.D$|\.dt_bias$|conv1d\.|\.bias$"
    r"|e_score_correction_bias$|router\.scale$|per_expert_scale$|layer_scalar$|rotary_emb"
)
# Parts sanitize drops (vision/audio towers, multi-token-prediction heads): never quantized.
_OTHER_TOWERS = re.compile(r"(^|\.)(vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector|mtp)\.")
_ATTN = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|qkv_proj)\.")
_ROUTED = re.compile(r"\.(switch_mlp|switch_glu)\.|\.experts\.(\d+\.)?|\.experts\.(gate_up_proj|down_proj)$")


def family_of(config: dict) -> str:
    """The model family (`model_type`) of a config.json dict."""
    mt = config.get("model_type", "")
    if mt in ("gemma4_text",):
        return "gemma4"
    if mt not in FAMILIES:
        raise RQError(f"model_type {mt!r} is not supported (supported: {', '.join(FAMILIES)})")
    return mt


def layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def role_of(name: str, config: dict) -> str:
    """The role of tensor `name` in a model with this config.json. Raises RQError for an unknown tensor."""
    fam = family_of(config)
    tc = text_config(config)
    if _NEVER.search(name) or _OTHER_TOWERS.search(name):
        return NEVER
    if "embed_tokens_per_layer" in name or name.endswith(("embed_tokens.weight", "embeddings.weight")):
        return EMBEDDINGS
    if name.startswith("lm_head.") or ".lm_head." in name:
        return LM_HEAD
    if _ROUTED.search(name):
        return ROUTED_EXPERT
    if fam == "qwen3_moe" or fam == "qwen2_moe":
        if _ATTN.search(name):
            return ATTENTION
        if ".mlp.shared_expert_gate." in name or re.search(r"\.mlp\.gate\.", name):
            return ROUTER
        if ".mlp.shared_expert." in name:
            return SHARED_EXPERT
        if re.search(r"\.mlp\.(gate|up|down)_proj\.", name):
            return DENSE_MLP
    elif fam == "nemotron_h":
        if _ATTN.search(name):
            return ATTENTION
        if re.search(r"\.mixer\.(in_proj|out_proj)\.", name):
            return MAMBA
        if re.search(r"\.mixer\.gate\.", name):
            return ROUTER
        if ".mixer.shared_experts." in name:
            return SHARED_EXPERT
        # latent projections run for every token, like a dense MLP: dense role
        if re.search(r"\.mixer\.(fc1_latent_proj|fc2_latent_proj|up_proj|down_proj)\.", name):
            return DENSE_MLP
    elif fam == "gemma4":
        if _ATTN.search(name):
            return ATTENTION
        if re.search(r"\.router\.proj\.", name):
            return ROUTER
        if re.search(r"\.mlp\.(gate|up|down)_proj\.", name):
            # Gemma 4's dense MLP runs in parallel with the routed experts: it is the shared expert.
            return SHARED_EXPERT if tc.get("enable_moe_block", True) else DENSE_MLP
        if re.search(r"\.per_layer_(input_gate|projection|model_projection)\.", name):
            return DENSE_MLP
    raise RQError(f"no role for tensor {name!r} in a {fam} model")


def module_path(name: str) -> str:
    """`a.b.weight` -> `a.b` (the module a parameter belongs to)."""
    return name.rsplit(".", 1)[0]


def roles_of(names, config: dict) -> dict[str, str]:
    """Role of every name; a tensor the family does not know raises RQError."""
    return {n: role_of(n, config) for n in names}
