"""Tiny random checkpoints of every family, with dimensions a quantizer can group (multiples of 32),
written in the Hugging Face layout (per-expert tensors) plus the golden tokenizer."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parent
TOKENIZER_SRC = ROOT / "golden" / "qwen2_moe" / "model"

TINY = {
    "qwen3_moe": {
        "torch_dtype": "bfloat16", "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 2,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 320,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "eos_token_id": 2,
    },
    "qwen2_moe": {
        "torch_dtype": "bfloat16", "model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False,
        "vocab_size": 320, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True,
        "eos_token_id": 2,
    },
    "nemotron_h": {
        "torch_dtype": "bfloat16", "model_type": "nemotron_h", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 96, "hybrid_override_pattern": "ME*E-", "num_hidden_layers": 5,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "mamba_num_heads": 4,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "vocab_size": 320, "layer_norm_epsilon": 1e-5,
        "norm_eps": 1e-5, "rope_theta": 10000, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_conv_bias": True, "mamba_proj_bias": False,
        "mlp_bias": False, "attention_bias": False, "use_bias": False, "residual_in_fp32": False, "moe_latent_size": 32, "eos_token_id": 2,
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
    },
    "gemma4": {
        "dtype": "bfloat16", "model_type": "gemma4", "tie_word_embeddings": True, "vocab_size": 320,
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "num_global_key_value_heads": 1, "head_dim": 32,
            "global_head_dim": 64, "num_hidden_layers": 3, "num_experts": 8, "top_k_experts": 2,
            "enable_moe_block": True, "attention_k_eq_v": True, "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "vocab_size": 320,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
            "tie_word_embeddings": True, "eos_token_id": 1,
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                   "rope_type": "proportional"},
                                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        },
    },
}

# Gemma 4 with the parts the plain tiny config leaves out: per-layer inputs and a KV-sharing layer
GEMMA_PLE = copy.deepcopy(TINY["gemma4"])
GEMMA_PLE["text_config"].update({"hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 320,
                                 "num_kv_shared_layers": 1, "num_hidden_layers": 4,
                                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                                 "full_attention"]})
# every family, and Gemma 4 with those parts: name -> config (None: the family's TINY config)
FAMILY_CASES = {"qwen3_moe": None, "qwen2_moe": None, "nemotron_h": None, "gemma4": None,
                "gemma4-ple-shared": GEMMA_PLE}


def available(family: str) -> bool:
    from rq_core.models import MODEL_TYPES

    try:
        MODEL_TYPES[family]
        return True
    except Exception:
        return False


def make_tiny(family: str, out: Path, seed: int = 0, config: dict | None = None, dtype: str = "bfloat16") -> Path:
    """Write a random-weight checkpoint of `family` into `out` (HF per-expert layout where the family has it)."""
    from rq_core.checkpoint import build_model

    cfg = json.loads(json.dumps(config or TINY[family]))
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = dtype
    mx.random.seed(seed)
    model = build_model(cfg)
    params = dict(tree_flatten(model.parameters()))
    weights: dict[str, mx.array] = {}
    for k, v in params.items():
        v = v.astype(getattr(mx, dtype))
        if family in ("qwen3_moe", "qwen2_moe") and ".switch_mlp." in k:
            prefix, rest = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                weights[f"{prefix}.experts.{e}.{rest}"] = v[e]
        else:
            weights[k] = v
    for k, v in list(weights.items()):  # zero-initialised routers would send every token to the same experts
        if v.ndim == 2 and k.endswith("gate.weight") and not bool(mx.any(v != 0).item()):
            weights[k] = (mx.random.normal(v.shape) * 0.5).astype(getattr(mx, dtype))
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (TOKENIZER_SRC / f).exists():
            shutil.copy(TOKENIZER_SRC / f, out / f)
    return out
