"""Qwen3-MoE (`qwen3_moe`): routed experts only (no shared expert), per-head q/k RMSNorm.

The network is Qwen2-MoE's (`qwen2_moe`); this ModelArgs names the parts it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from rq_core.models import qwen2_moe

Model = qwen2_moe.Model


@dataclass
class ModelArgs(qwen2_moe.ModelArgs):
    model_type: str = "qwen3_moe"
    num_hidden_layers: int = 48
    intermediate_size: int = 6144
    num_attention_heads: int = 32
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    shared_expert_intermediate_size: Optional[int] = None  # None: no shared expert
    attention_bias: bool = False

    qk_norm: ClassVar[bool] = True

    @property
    def projection_biases(self) -> tuple[bool, bool]:
        """(q/k/v, o) biases: Qwen3-MoE's attention_bias sets all four projections'."""
        return self.attention_bias, self.attention_bias

    def default_layer_types(self) -> list[str]:
        # transformers' Qwen3-MoE applies the window to every layer when enabled.
        return ["sliding_attention"] * self.num_hidden_layers
