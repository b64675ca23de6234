"""Every tensor of every family gets a role; the never-quantized ones are recognised."""

import json
from pathlib import Path

import pytest
from mlx.utils import tree_flatten

from _tiny_models import TINY, available
from rq_core.errors import RQError
from rq_core.quant.roles import NEVER, ROLES, role_of

CONFIGS = Path(__file__).parent / "data" / "configs"


@pytest.mark.parametrize("name,role", [
    ("model.layers.0.self_attn.q_proj.weight", "attention"),
    ("model.layers.0.self_attn.q_norm.weight", NEVER),
    ("model.layers.3.mlp.experts.7.up_proj.weight", "routed_expert"),
    ("model.layers.3.mlp.switch_mlp.down_proj.weight", "routed_expert"),
    ("model.layers.3.mlp.switch_mlp.down_proj.scales", "routed_expert"),
    ("model.layers.3.mlp.gate.weight", "router"),
    ("model.layers.3.mlp.gate_proj.weight", "dense_mlp"),
    ("model.embed_tokens.weight", "embeddings"),
    ("lm_head.weight", "lm_head"),
    ("model.norm.weight", NEVER),
])
def test_qwen3_names(name, role):
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    assert role_of(name, cfg) == role


def test_qwen2_shared_expert_and_gate():
    cfg = {"model_type": "qwen2_moe"}
    assert role_of("model.layers.0.mlp.shared_expert.up_proj.weight", cfg) == "shared_expert"
    assert role_of("model.layers.0.mlp.shared_expert_gate.weight", cfg) == "router"
    assert role_of("model.layers.0.self_attn.q_proj.bias", cfg) == NEVER


def test_nemotron_names():
    cfg = json.loads((CONFIGS / "nemotron3-super-120b-a12b.json").read_text())
    r = lambda n: role_of(n, cfg)  # noqa: E731
    assert r("backbone.layers.0.mixer.in_proj.weight") == "mamba"
    assert r("backbone.layers.0.mixer.out_proj.weight") == "mamba"
    for n in ["A_log", "D", "dt_bias", "conv1d.weight", "conv1d.bias", "norm.weight"]:
        assert r(f"backbone.layers.0.mixer.{n}") == NEVER, n
    assert r("backbone.layers.1.mixer.experts.3.up_proj.weight") == "routed_expert"
    assert r("backbone.layers.1.mixer.switch_mlp.fc1.weight") == "routed_expert"
    assert r("backbone.layers.1.mixer.shared_experts.down_proj.weight") == "shared_expert"
    assert r("backbone.layers.1.mixer.gate.weight") == "router"
    assert r("backbone.layers.1.mixer.gate.e_score_correction_bias") == NEVER
    assert r("backbone.layers.1.mixer.fc1_latent_proj.weight") == "dense_mlp"
    assert r("backbone.layers.7.mixer.q_proj.weight") == "attention"
    assert r("backbone.embeddings.weight") == "embeddings"
    assert r("mtp.layers.0.mixer.q_proj.weight") == NEVER  # dropped by sanitize


def test_gemma4_parallel_dense_mlp_is_shared():
    cfg = json.loads((CONFIGS / "gemma4-26b-a4b.json").read_text())
    assert role_of("language_model.model.layers.0.mlp.up_proj.weight", cfg) == "shared_expert"
    assert role_of("language_model.model.layers.0.experts.switch_glu.up_proj.weight", cfg) == "routed_expert"
    assert role_of("model.language_model.layers.0.experts.gate_up_proj", cfg) == "routed_expert"
    assert role_of("language_model.model.layers.0.router.proj.weight", cfg) == "router"
    assert role_of("language_model.model.layers.0.router.scale", cfg) == NEVER
    assert role_of("model.vision_tower.encoder.layers.0.mlp.fc1.weight", cfg) == NEVER


def test_unknown_tensor_is_one_line_error():
    with pytest.raises(RQError, match="no role for tensor"):
        role_of("model.layers.0.mystery.weight", {"model_type": "qwen3_moe"})
    with pytest.raises(RQError, match="not supported"):
        role_of("x.weight", {"model_type": "llama"})


@pytest.mark.parametrize("family", list(TINY))
def test_every_parameter_of_every_family_has_a_role(family):
    if not available(family):
        pytest.skip(f"model family {family} not in this build yet")
    from rq_core.checkpoint import build_model

    cfg = TINY[family]
    names = [k for k, _ in tree_flatten(build_model(cfg).parameters())]
    roles = {role_of(n, cfg) for n in names}
    assert "routed_expert" in roles and "attention" in roles and NEVER in roles
    assert roles <= set(ROLES) | {NEVER}
